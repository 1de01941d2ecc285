"""Resharding throughput: Megatron TP-t shards -> vLLM TP-k flat buffers through the C++ executor,
against a plain copy of the same number of bytes (numpy.copyto and torch's copy_) in the same run.

    python benchmarks/sync.py [--dtypes bf16,fp32] [--threads 1,2] [--repeats 5] [--layers 24]
    python benchmarks/sync.py --publish [--dtypes bf16] [--threads 2] [--layers 24]

The model has Qwen2.5-0.5B's dimensions (H=896, 24 layers, nq=14, nkv=2, d=64, F=4864, V=151936,
QKV bias, tied embeddings) with random weights. Each layout pair is timed writing every destination
rank once into preallocated buffers (best of --repeats, interleaved with the baseline, after one
warm-up); GB/s counts bytes written to the destination (copies plus zero fills). The baseline
copies the same number of bytes into the same destination buffers from one contiguous source, one
copy per rank, with the same thread count. Nothing else should run meanwhile; on the shared 2-core
machines, say what did.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from libra.sync import ModelShape, build_transfer_plan, execute, logical_tensors, megatron_layout, vllm_layout

QWEN25_05B = ModelShape(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    ffn_hidden_size=4864,
    vocab_size=151936,
    tie_embeddings=True,
    qkv_bias=True,
)
# (Megatron TP, Megatron PP, vLLM TP). nq=14 rules out TP=4 on either side.
LAYOUT_PAIRS = [(2, 1, 1), (1, 1, 2), (2, 2, 2), (1, 2, 1)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def best_seconds(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Best time of each function, measured interleaved so that load from other processes on the
    shared machine hits all of them alike; one warm-up call each (page faults of fresh buffers are
    not part of a steady-state publication)."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def random_shards(plan, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        key: torch.empty(plan.source_numel(key), dtype=dtype).uniform_(-1, 1, generator=gen)
        for key in plan.source_keys
    }


def baseline_copies(dsts: list[torch.Tensor], threads: int) -> dict[str, Callable[[], None]]:
    """Plain copies of the same bytes into the same destination buffers, from one random source."""
    outs = [d.view(torch.uint8) for d in dsts]
    src = torch.empty(max(o.numel() for o in outs), dtype=torch.uint8).random_(0, 255)

    def torch_copy() -> None:
        for out in outs:
            out.copy_(src[: out.numel()])

    copies = {"torch copy_": torch_copy}
    if threads == 1:  # numpy.copyto is single-threaded
        pairs = [(o.numpy(), src[: o.numel()].numpy()) for o in outs]

        def numpy_copy() -> None:
            for out, part in pairs:
                np.copyto(out, part)

        copies["numpy.copyto"] = numpy_copy
    return copies


def bench_pair(
    table: Table,
    shape: ModelShape,
    dtype_name: str,
    pair: tuple[int, int, int],
    thread_counts: list[int],
    repeats: int,
) -> None:
    """One (Megatron TP, PP) -> vLLM TP row per thread count: plan time, executor and memcpy GB/s."""
    tp, pp, dst_tp = pair
    dtype = DTYPES[dtype_name]
    start = time.perf_counter()
    plan = build_transfer_plan(
        megatron_layout(shape, tp, pp),
        vllm_layout(shape, dst_tp),
        logical_tensors(shape),
        torch.empty((), dtype=dtype).element_size(),
    )
    plan_ms = (time.perf_counter() - start) * 1e3
    num_runs = sum(len(plan.runs(r)) for r in range(dst_tp))
    shards = random_shards(plan, dtype)
    dsts = [torch.empty(plan.rank_numel(r), dtype=dtype) for r in range(dst_tp)]
    total_bytes = sum(plan.rank_bytes(r) for r in range(dst_tp))
    for threads in thread_counts:

        def reshard(threads: int = threads) -> None:
            for rank in range(dst_tp):
                execute(plan, rank, shards, dsts[rank], num_threads=threads)

        torch.set_num_threads(threads)
        seconds = best_seconds({"reshard": reshard, **baseline_copies(dsts, threads)}, repeats)
        gbps = total_bytes / seconds.pop("reshard") / 1e9
        best_name, best = min(seconds.items(), key=lambda item: item[1])
        best = total_bytes / best / 1e9
        table.add_row(
            dtype_name,
            f"{tp},{pp} -> {dst_tp}",
            f"{total_bytes / 1e9:.2f}",
            f"{plan_ms:.0f}",
            str(num_runs),
            str(threads),
            f"{gbps:.2f}",
            f"{best:.2f} ({best_name})",
            f"{gbps / best:.2f}",
        )


def run(shape: ModelShape, dtype_names: list[str], thread_counts: list[int], repeats: int) -> None:
    console = Console(width=150)
    table = Table(title=f"resharding {shape.num_layers}-layer Qwen2.5-0.5B-shaped model")
    for column in (
        "dtype",
        "t,p -> k",
        "GB",
        "plan ms",
        "runs",
        "threads",
        "reshard GB/s",
        "memcpy GB/s",
        "ratio",
    ):
        table.add_column(column, justify="right")
    for dtype_name in dtype_names:
        for tp, pp, dst_tp in LAYOUT_PAIRS:
            bench_pair(table, shape, dtype_name, (tp, pp, dst_tp), thread_counts, repeats)
    console.print(table)


# -- end-to-end publication into vLLM ----------------------------------------------------------


def write_random_checkpoint(shape: ModelShape, directory: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Qwen2-shaped HF folder with random weights (no tokenizer: the engine runs token ids)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        tie_word_embeddings=shape.tie_embeddings,
        max_position_embeddings=256,
        torch_dtype=str(dtype).removeprefix("torch."),
    ).save_pretrained(directory)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (rows, cols) in logical_tensors(shape).items():
        size = (rows,) if cols == 1 else (rows, cols)
        tensors[name] = torch.empty(size).uniform_(-0.05, 0.05, generator=gen).to(dtype)
    save_file(tensors, f"{directory}/model.safetensors")
    return tensors


def run_publish(shape: ModelShape, dtype_name: str, threads: int) -> None:
    """Megatron TP=2 shards -> two instances (TP=1 and TP=2 layouts), Libra's path (reshard into
    shared memory + worker-extension load) against the naive one (gather full HF tensors, send them
    as safetensors bytes, vLLM `reload_weights`), into one in-process TP=1 engine. The second
    instance's load is timed on the same engine (a TP=2 engine does not fit this 2-core machine's
    test budget), so "2 instances" = publish once for both layouts + 2 loads."""
    import tempfile

    from libra.backends import get_backend
    from libra.rollout.config import InstanceConfig
    from libra.rollout.engine import configure_vllm_env

    configure_vllm_env(InstanceConfig().for_backend(get_backend("cpu")))  # before vLLM is imported
    from safetensors.torch import save
    from vllm import LLM

    from libra.model_spec import ModelSpec
    from libra.sync.instance_update import apply_version
    from libra.sync.publisher import WeightPublisher
    from libra.sync.shm import ShmSender
    from libra.sync.vllm_loader import WORKER_EXTENSION
    from libra.training.hf_weights import hf_to_megatron, megatron_to_hf
    from libra.training.model import ModelArchitecture

    dtype = DTYPES[dtype_name]
    console = Console(width=150)
    with tempfile.TemporaryDirectory() as directory:
        hf = write_random_checkpoint(shape, directory, dtype)
        arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(directory))
        per_rank = [
            hf_to_megatron(hf.__getitem__, arch, tp_rank=r, tp_size=2, pp_rank=0, pp_size=1) for r in range(2)
        ]
        shards = {(r, 0, name): t for r, part in enumerate(per_rank) for name, t in part.items()}
        llm = LLM(
            model=directory,
            dtype=dtype_name.replace("bf16", "bfloat16").replace("fp32", "float32"),
            enforce_eager=True,
            max_model_len=256,
            skip_tokenizer_init=True,
            worker_extension_cls=WORKER_EXTENSION,
        )
        plans = {
            tp: build_transfer_plan(
                megatron_layout(shape, 2, 1), vllm_layout(shape, tp), logical_tensors(shape), dtype.itemsize
            )
            for tp in (1, 2)
        }
        table = Table(
            title=f"publish a {shape.num_layers}-layer Qwen2.5-0.5B-shaped model ({dtype_name}), 2 instances"
        )
        for column in ("path", "version", "publish s", "load 1 s", "load 2 s", "total s"):
            table.add_column(column, justify="right")
        sender = ShmSender()
        publisher = WeightPublisher(plans, sender, dtype, num_threads=threads)
        for version in (1, 3):  # the first round includes page faults of fresh segments
            start = time.perf_counter()
            publication = publisher.publish(version, shards)
            publish_s = time.perf_counter() - start
            loads = []
            for instance_version in (version, version + 1):  # two instances: two loads of the same buffers
                request = publication.load_request(1).to_dict()
                request["version"] = instance_version
                for rank in request["ranks"]:
                    rank["manifest"]["version"] = instance_version
                start = time.perf_counter()
                result = apply_version(llm, request)
                loads.append(time.perf_counter() - start)
                assert result.ok, result.error
            publisher.release(version)
            table.add_row(
                "libra shm",
                str(version),
                f"{publish_s:.2f}",
                f"{loads[0]:.2f}",
                f"{loads[1]:.2f}",
                f"{publish_s + sum(loads):.2f}",
            )
        sender.close()
        for round_ in (1, 2):
            start = time.perf_counter()
            full = megatron_to_hf([per_rank[0], per_rank[1]], arch, pp_rank=0, pp_size=1)
            blob = save(full)
            gather_s = time.perf_counter() - start
            loads = []
            for _ in range(2):
                start = time.perf_counter()
                llm.collective_rpc("libra_reload_hf", args=(blob,))
                llm.reset_prefix_cache()
                loads.append(time.perf_counter() - start)
            table.add_row(
                "naive gather+reload_weights",
                f"round {round_}",
                f"{gather_s:.2f}",
                f"{loads[0]:.2f}",
                f"{loads[1]:.2f}",
                f"{gather_s + sum(loads):.2f}",
            )
        console.print(table)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--threads", default="1,2", help="comma-separated executor/baseline thread counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--layers",
        type=int,
        default=QWEN25_05B.num_layers,
        help="fewer layers for a quick run (must stay even for the PP=2 pairs)",
    )
    parser.add_argument(
        "--publish",
        action="store_true",
        help="instead: end-to-end publication into a vLLM engine against the naive path (first dtype, "
        "first thread count)",
    )
    args = parser.parse_args()
    shape = ModelShape(**{**QWEN25_05B.__dict__, "num_layers": args.layers})
    if args.publish:
        run_publish(shape, args.dtypes.split(",")[0], int(args.threads.split(",")[0]))
        return
    run(shape, args.dtypes.split(","), [int(t) for t in args.threads.split(",")], args.repeats)


if __name__ == "__main__":
    main()
