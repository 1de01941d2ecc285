"""The `libra` command. Subcommands arrive with the components they drive."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from libra.config import LibraConfig, load_config, load_from_file
from libra.logs import LOG_DIR_ENV, configure_logging
from libra.tasks.tiny_model import ARCHES

logger = logging.getLogger("libra")

ADDRESS_FILE = "controller.addr"


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="Python config file defining config() -> LibraConfig")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.field=value", help="config overrides, e.g. control.port=0"
    )


def _load(args: argparse.Namespace) -> LibraConfig:
    return load_config(args.config, args.overrides)


def _controller_address(args: argparse.Namespace, config: LibraConfig) -> str:
    if args.controller:
        return args.controller
    address_file = Path(config.run_dir) / ADDRESS_FILE
    if address_file.is_file():
        return address_file.read_text().strip()
    raise ValueError(f"no controller address: pass --controller HOST:PORT or run where {address_file} exists")


def _client_token(args: argparse.Namespace, config: LibraConfig) -> str:
    from libra.control.auth import read_token_file, resolve_token

    if args.token_file:
        return read_token_file(args.token_file)
    return resolve_token(config.control, config.run_dir, create=False)


def _serve_until_signalled(component) -> None:
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    component.stop()


def cmd_controller(args: argparse.Namespace) -> int:
    from libra.control import Controller

    config = _load(args)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    controller = Controller(config).start()
    (run_dir / ADDRESS_FILE).write_text(controller.address + "\n")
    print(
        f"controller listening on {controller.address}; token in {run_dir / 'token'} (or $LIBRA_TOKEN)",
        flush=True,
    )
    _serve_until_signalled(controller)
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from libra.control import NodeAgent

    config = _load(args)
    agent = NodeAgent(config, _controller_address(args, config), _client_token(args, config), port=args.port)
    agent.start()
    print(
        f"agent {agent.agent_id} serving on {agent.address} with {len(agent.devices)} device(s)", flush=True
    )
    _serve_until_signalled(agent)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from libra.control import ClusterClient
    from libra.control.status_view import render_events, render_state

    config = _load(args)
    with ClusterClient(
        _controller_address(args, config), _client_token(args, config), config.control
    ) as client:
        state = client.cluster_state()
        render_state(state)
        if args.watch:
            try:
                render_events(client.watch_events(after_sequence=state.last_event_sequence))
            except KeyboardInterrupt:
                pass
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from libra.planner import NoFeasiblePlan, PlanningProblem, search

    problem = load_from_file(args.planner_config, "planning_problem", PlanningProblem)
    try:
        plan = search(problem)
    except NoFeasiblePlan as e:
        raise ValueError(f"no feasible plan: {e}") from e
    print(plan.describe())
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    import dataclasses

    from libra.sim import load_sim_config, run_comparison
    from libra.sim.report import markdown_report, write_report

    config = load_sim_config(args.sim_config)
    if args.calibrate_vllm:
        config = _calibrated_by_vllm(config, args.calibrate_vllm)
    if args.steps:
        config = dataclasses.replace(config, num_steps=args.steps)
    if args.policies:
        config = dataclasses.replace(config, policies=tuple(args.policies.split(",")))
    comparison = run_comparison(config)
    if args.out:
        print(f"report written to {write_report(comparison, args.out, plots=not args.no_plots)}")
    else:
        print(markdown_report(comparison))
    return 0


def _calibrated_by_vllm(config, specs: list[str]):
    """The sim config with its rollout factors fitted to `vllm bench latency` files; prints the
    fit and each run's held-out error."""
    import dataclasses

    from libra.sim.calibration import LatencyRun, calibrate_rollout_by_vllm

    runs = [LatencyRun.parse(spec) for spec in specs]
    factors, errors = calibrate_rollout_by_vllm(config.cluster, config.model, config.planner, runs)
    print(
        f"rollout factors fitted to {len(runs)} vLLM runs: compute {factors.compute:.3g}, memory "
        f"{factors.memory:.3g}, communication {factors.communication:.3g}, "
        f"overhead {factors.overhead_s * 1e3:.3g} ms a step"
    )
    for e in errors:
        print(
            f"  held out {e.label}: predicted {e.predicted_s:.3f} s, "
            f"measured {e.measured_s:.3f} s ({e.relative_error:+.1%})"
        )
    return dataclasses.replace(config, rollout_factors=factors)


def cmd_run(args: argparse.Namespace) -> int:
    import dataclasses

    from libra.job.run import run_job

    config = load_config(args.job_config, args.overrides)
    if args.resume:
        config = dataclasses.replace(config, run_dir=args.resume)
    # The job's own log and those of every worker it starts, as JSON lines in the run folder.
    os.environ.setdefault(LOG_DIR_ENV, str(Path(config.run_dir).resolve() / "logs"))
    configure_logging("job", args.verbose)
    run_job(config, resume=bool(args.resume))
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    import dataclasses

    from libra.tasks.tiny_model import TinyModelSpec, make_tiny_model

    shape = dict(
        arch=args.arch,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        seed=args.seed,
    )
    shape = {name: value for name, value in shape.items() if value is not None}
    if not args.random:
        from libra.tasks.warm_start import WarmStartConfig, make_warm_started_model

        recipe = WarmStartConfig()
        recipe = dataclasses.replace(recipe, spec=dataclasses.replace(recipe.spec, **shape))
        report = make_warm_started_model(args.dir, recipe)
        test = report["test"]
        print(
            f"warm-started tiny model written to {args.dir} (step {report['kept_step']}; held-out success "
            f"{test['success_rate']:.2f}, well-formed turns {test['wellformed_turn_rate']:.2f}; "
            f"details in warm_start.json)",
            flush=True,
        )
        return 0
    spec = TinyModelSpec(**shape)
    out = make_tiny_model(args.dir, spec)
    print(f"tiny {spec.arch} model written to {out}", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="libra", description="Agentic RL post-training runtime.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("controller", help="run the controller (gRPC control plane)")
    _config_args(p)
    p.set_defaults(func=cmd_controller)

    p = sub.add_parser("agent", help="run a node agent that owns this host's devices")
    _config_args(p)
    p.add_argument("--controller", help="controller HOST:PORT (default: from the run folder)")
    p.add_argument("--token-file", help="file holding the run's bearer token")
    p.add_argument("--port", type=int, default=0, help="port of the agent's own service (0: any free)")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("status", help="print the cluster state (and follow events with --watch)")
    _config_args(p)
    p.add_argument("--controller", help="controller HOST:PORT (default: from the run folder)")
    p.add_argument("--token-file", help="file holding the run's bearer token")
    p.add_argument("--watch", action="store_true", help="keep printing events as they happen")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("plan", help="print the planner's plan and predicted times for a cluster description")
    p.add_argument("planner_config", metavar="CONFIG", help="Python file defining planning_problem()")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="simulate the policies of a cluster config and compare them")
    p.add_argument("sim_config", metavar="CONFIG", help="Python file defining sim_config()")
    p.add_argument("--out", help="folder for report.md and PNG plots (default: print the report)")
    p.add_argument("--steps", type=int, default=0, help="override num_steps")
    p.add_argument("--policies", help="comma-separated policy names (default: the config's)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--calibrate-vllm",
        action="append",
        metavar="FILE:tp=K,batch=B,input=I,output=O",
        help="fit the rollout factors to a `vllm bench latency --output-json FILE` run on the target "
        "nodes (repeat for each TP size x batch x context measured)",
    )
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("run", help="run an RL job from a config file (configs/tiny_cpu.py ...)")
    p.add_argument("job_config", metavar="CONFIG", help="Python config file defining config() -> LibraConfig")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("overrides", nargs="*", metavar="section.field=value")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("make-tiny-model", help="build a tiny model with a locally trained tokenizer into DIR")
    p.add_argument("dir", metavar="DIR", help="output folder (HF: safetensors, tokenizer, chat template)")
    p.add_argument(
        "--random",
        action="store_true",
        help="random weights (default: warm-started by a short SFT on procedural tasks, cached)",
    )
    # Shape defaults (None) come from TinyModelSpec, or from the warm-start recipe's spec.
    p.add_argument("--arch", choices=ARCHES, default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow an option (`libra run CONFIG --resume RUN_DIR a.b=1`): argparse stops
    # filling a positional list at the first option and leaves the rest over.
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    configure_logging(args.command, args.verbose)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"libra {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - gRPC errors reach the user as one readable line
        import grpc

        from libra.job.loop import TrainingLost

        if isinstance(e, grpc.RpcError):
            print(f"libra {args.command}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        if isinstance(e, TrainingLost):
            print(f"libra {args.command}: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
