"""The device check that the launch scripts and CI run (`scripts/check_cuda.sh`, `python -m
libra.checks`): one line per check with its measured figure, exit status 1 when any failed.

It owns the checks themselves, one file each, on the backend's own device: `backend`,
`model_logits` (Megatron against transformers), `bf16_step` (bf16 with fp32 main parameters
against fp32), `rollout_engine` (a vLLM instance with the backend's engine defaults: greedy
against transformers, decode tokens/s), `publication` (trainer to instance, bit for bit) and
`job_run` (five steps of `libra run`); the state they share (`context`, and the rollout instance
of `instance`), and the runner that prints their lines and writes the JSON summary.
"""
