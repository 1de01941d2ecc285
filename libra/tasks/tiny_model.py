"""The tiny model factory: a random Llama/Qwen2-style model with a locally trained tokenizer.

Nothing can be downloaded at run time (PLATFORM.md), so tests, benchmarks and the embedded default
build their model here: a byte-level BPE tokenizer trained with `tokenizers` on a generated corpus
of chat, tool-call and arithmetic text, a Hermes/Qwen-style chat template with tool calls, and a
randomly initialised fp32 model saved with `save_pretrained` (safetensors). The folder loads
offline with `AutoTokenizer`, `AutoModelForCausalLM` and vLLM.

The chat markers and the tool-call tags are *special tokens* (one id each), so an engine can stop
on `</tool_call>` with `stop_token_ids` and the agent loop can find turn boundaries in token ids
without decoding.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from libra.rollout.chat import (
    IM_END,
    IM_START,
    PAD,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)

SPECIAL_TOKENS = (
    PAD,
    IM_START,
    IM_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Hermes / Qwen2.5 style. An assistant turn with tool calls renders each call as
# `<tool_call>\n{json}\n</tool_call>`; a tool result is a user turn wrapped in <tool_response>.
# The template has no incidental whitespace (it is one concatenated string), so no `{%-` trimming.
CHAT_TEMPLATE = (
    "{% if messages and messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '" + DEFAULT_SYSTEM_PROMPT + "' %}"
    "{% set rest = messages %}{% endif %}"
    "<|im_start|>system\n{{ system }}"
    "{% if tools %}\n\n# Tools\n\nYou may call functions. Signatures:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    'Call one as: <tool_call>\n{"name": <name>, "arguments": <json object>}\n</tool_call>'
    "{% endif %}<|im_end|>\n"
    "{% for message in rest %}"
    "{% if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set fn = call.function or call %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": {{ fn.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


ARCHES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. Defaults: ~0.6M parameters, builds in a few seconds."""

    arch: str = "llama"
    """`llama` (LlamaForCausalLM), `qwen2` (Qwen2ForCausalLM: biases on q/k/v) or `qwen3`
    (Qwen3ForCausalLM: RMSNorm on q and k, no biases; the accelerator configs' family)."""
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 2048
    init_std: float = 0.1
    """Std of the random weights. Larger than HF's 0.02 so that logits are peaked: greedy choices
    then have clear margins and agree across engines despite fp32 rounding differences."""
    norm_std: float = 0.0
    """Std of the norms' weights around 1 (0: HF's ones): apart from 1, a weight mapping that
    swaps two norms changes the logits."""
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"arch must be one of {', '.join(map(repr, ARCHES))}, got {self.arch!r}")
        if self.vocab_size < 300:
            raise ValueError(
                f"vocab_size must be >= 300 (256 bytes + specials + merges), got {self.vocab_size}"
            )
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if (self.hidden_size // self.num_heads) % 32:
            # vLLM's CPU attention kernels support head sizes 32, 64, 80, 96, 112, 128, ... only.
            raise ValueError(
                f"hidden_size / num_heads (the head size, {self.hidden_size // self.num_heads}) must be a "
                "multiple of 32 for vLLM's CPU attention"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Builds tokenizer + random model into `out_dir` (created; existing files overwritten)."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, seed=spec.seed)
    tokenizer.save_pretrained(out)
    model = build_random_model(spec, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer trained on `corpus_lines`, wrapped for transformers with the chat
    template and the chat markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(seed=seed), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        model_max_length=1 << 20,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_random_model(spec: TinyModelSpec, tokenizer):
    """A randomly initialised fp32 causal LM of `spec`'s shape, with the tokenizer's special ids."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        bos_token_id=None,
        tie_word_embeddings=spec.tie_word_embeddings,
        torch_dtype="float32",
    )
    if spec.arch == "qwen3":  # Qwen3 states its head size (HF's default of 128 is the real models')
        config = Qwen3Config(**common, head_dim=spec.hidden_size // spec.num_heads)
    else:
        config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[spec.arch](**common)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.norm_std:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, spec.norm_std)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = None
    return model


# The tokenizer corpus: the kinds of text the agent loop feeds the model, so that BPE merges cover
# the chat markup, tool-call JSON and numbers compactly.

_WORDS = (
    "the answer is what compute calculate please number sum product result value total of and "
    "with use tool function call expression error unknown invalid json arguments name you are a "
    "helpful assistant question how much many times plus minus divided by equals let me check "
    "first then so final".split()
)


def _expression(rng: random.Random) -> str:
    terms = [str(rng.randint(0, 999)) for _ in range(rng.randint(2, 4))]
    return "".join(t + rng.choice("+-*/") for t in terms[:-1]) + terms[-1]


def corpus_lines(num_dialogs: int = 3000, seed: int = 0) -> list[str]:
    """Generated chat transcripts with calculator tool calls, plus free text."""
    rng = random.Random(seed)
    tool = {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }
    lines = [json.dumps(tool), DEFAULT_SYSTEM_PROMPT]
    for _ in range(num_dialogs):
        expr = _expression(rng)
        call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(
            f"{IM_START}user\nWhat is {expr}? {words}{IM_END}\n{IM_START}assistant\n"
            f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}{IM_END}\n{IM_START}user\n{TOOL_RESPONSE_START}\n"
            f"{rng.uniform(-1e4, 1e4):.4g}\n{TOOL_RESPONSE_END}{IM_END}\n{IM_START}assistant\nThe answer is "
            f"{rng.randint(-9999, 9999)}.{IM_END}\n"
        )
    return lines + _procedural_lines(num_dialogs // 3, seed)


def _procedural_lines(num_tasks: int, seed: int) -> list[str]:
    """Easy procedural arithmetic transcripts (the warm-start family), so that its prompt phrases,
    call JSON and small numbers become few tokens each."""
    from libra.tasks.procedural import generate_suite

    lines = []
    # A negative seed: these tasks are none of the (non-negative) seeds' suites.
    for task in generate_suite(num_tasks, -1 - seed, "arithmetic", max_calls=6, difficulty="easy").tasks:
        turns = [f"{IM_START}user\n{task.record.prompt}{IM_END}\n{IM_START}assistant\n"]
        for step in task.demonstration:
            call = json.dumps({"name": step.call.name, "arguments": step.call.arguments})
            turns.append(
                f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}{IM_START}user\n{TOOL_RESPONSE_START}\n"
                f"{step.expected_in_result}\n{TOOL_RESPONSE_END}{IM_END}\n{IM_START}assistant\n"
            )
        lines.append("".join(turns) + f"{task.final_response}{IM_END}\n")
    return lines
