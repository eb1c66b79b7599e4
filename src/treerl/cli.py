"""The `treerl` command line: train, eval, serve, export, bench, tree-stats."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

TRUST_HELP = ("load a trainer state that is not plain data (a checkpoint of an older treerl) by unpickling it in "
              "full, which runs any code the file names: only for files you trust (config: train.trust_checkpoint)")


def _user_errors() -> tuple[type[BaseException], ...]:
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .learner import NonFiniteError
    from .tasks.base import DatasetError, RewardError
    from .devtools.tree_stats import RolloutsError

    return (ConfigError, CheckpointError, DatasetError, RewardError, RolloutsError, NonFiniteError, FileNotFoundError)


def cmd_train(args: argparse.Namespace) -> int:
    from .config import Config
    from .run import train

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        overrides.insert(0, config)
        config = None
    if args.trust_checkpoint:
        overrides.append("train.trust_checkpoint=true")
    cfg = Config.from_yaml(config, overrides)
    try:
        # under torchrun (WORLD_SIZE > 1) every rank runs this; the trainer joins the group
        with _terminate_as_interrupt():
            train(cfg, resume=args.resume, overwrite=args.overwrite)
        from .distributed.data_parallel import leave

        leave()  # a rank of a multi-process run ends here (exit status 0); one process goes on
    except KeyboardInterrupt as interrupt:
        from .runlog import resume_hint

        release_interrupted(interrupt, "treerl train")
        print(f"treerl train: interrupted; {resume_hint(cfg.train.out_dir, config)}", file=sys.stderr)
        return 130
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def release_interrupted(interrupt: BaseException, command: str) -> None:
    """Free now what ``interrupt`` cut short, before the command's last words: the frames it
    unwound and what they held. A signal can land inside a library's constructor (a progress
    bar of a checkpoint's save, session 23's CI) and leave an object half built, whose
    finalizer then fails; freed here, its failure comes before the resume hint, as one line
    naming it, instead of a traceback after the hint."""
    def one_line(unraisable) -> None:
        where = getattr(unraisable.object, "__qualname__", type(unraisable.object).__name__)
        print(f"{command}: while stopping, {where} failed: {unraisable.exc_type.__name__}: {unraisable.exc_value}",
              file=sys.stderr)

    hook, sys.unraisablehook = sys.unraisablehook, one_line
    try:
        traceback.clear_frames(interrupt.__traceback__)  # (the frames' locals: what they held goes now)
        gc.collect()
    finally:
        sys.unraisablehook = hook


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGINT and SIGTERM end a one-process run with a clean stop and a resume hint. Both
    handlers are installed explicitly: a process started with SIGINT ignored (a background
    job of a non-interactive shell; in CI, a child of a test process where an earlier test
    ignored it) inherits that, and Python then installs no Ctrl-C handler of its own.
    The handler raises KeyboardInterrupt and sets ``runlog.stop_requested``: an exception
    raised inside a finalizer is dropped by Python, and the flag stops the run at its next step.
    Under torchrun (WORLD_SIZE > 1) the launcher's own handling is left alone."""
    if os.environ.get("WORLD_SIZE", "1") != "1" or threading.current_thread() is not threading.main_thread():
        yield
        return

    from .runlog import stop_requested

    stop_requested.clear()

    def interrupt(signum, frame):
        stop_requested.set()  # the run also stops at its next step should this exception be swallowed
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_requested.clear()  # a later run in this process (the library API) starts unstopped


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from .build import load_saved
    from .checkpoint import load_state, resolve_checkpoint
    from .config import Config, ConfigError
    from .preflight import check_device
    from .trainer import Trainer

    if args.n is not None and args.n < 1:
        raise ConfigError(f"eval -n: {args.n} is not allowed; allowed: a whole number >= 1 (held-out problems)")
    check_device(args.device, "--device")
    path = resolve_checkpoint(args.checkpoint)
    state = load_state(path, trust=args.trust_checkpoint)
    cfg = Config.from_dict(state["config"])
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value (e.g. task.kwargs.path=my.jsonl)")
        cfg.set(key, __import__("yaml").safe_load(value))
    cfg.train.device = args.device
    model, tokenizer = load_saved(path / "model", cfg, checkpoint=path, device=args.device)
    if cfg.model.lora:  # a LoRA run: its adapter is merged into the loaded model, evaluated as a plain one
        cfg.model.lora = {}
    trainer = Trainer(cfg, model=model, tokenizer=tokenizer)
    torch.manual_seed(cfg.train.seed)
    result = trainer.evaluate(args.n)
    print(f"{path}: task {cfg.task.name}, {args.n or cfg.train.eval_problems} held-out problems: "
          f"accuracy {result['eval/accuracy']:.3f}, mean reward {result['eval/reward']:.3f}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .devtools.benchmark import main as bench_main, parser as bench_parser

    if "-h" in args.rest or "--help" in args.rest:
        bench_parser().print_help()
        raise SystemExit(0)
    bench_main(args.rest)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve.server import serve

    return serve(args)


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_merged

    out = export_merged(args.run, args.out)
    print(f"treerl export: wrote the merged model to {out}")
    return 0


def cmd_tree_stats(args: argparse.Namespace) -> int:
    from .devtools.tree_stats import main as stats_main

    return stats_main(args.rollouts, plot=args.plot)


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config whose model section builds the model (optional)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--weights", metavar="PATH",
                   help="a treerl checkpoint or run directory, or a Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: an ephemeral port (printed)")
    p.add_argument("--model-name", default="treerl", help="the name clients pass as model")
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    p.add_argument("--max-rows", type=int, default=256, help="most rows of the running batch")
    p.add_argument("--prefix-cache-tokens", type=int, default=None,
                   help="K/V tokens of prompts and finished responses kept for later turns that extend "
                        "them (0: off); "
                        "default: the config's rollout.prefix_cache_tokens, else rollout.max_batch_tokens")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="prompt tokens prefilled together in one piece (bounds the temporary K/V); "
                        "default: the config's rollout.prefill_chunk_tokens (8192)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default=None,
                   help="the running batch's K/V: auto (the model's dtype, exact) or fp8 (float8 e4m3: half the bytes "
                        "a decode step reads, not exact; docs/SERVING.md); default: the config's rollout.kv_cache_dtype")
    p.add_argument("--idle-timeout-s", type=float, default=1.0,
                   help="a running batch ends after this long without work (the next request starts another)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls (hermes: Qwen2.5/Qwen3 <tool_call>{json}</tool_call>; "
                        "tag: <NAME>VALUE</NAME>); without it, requests with tools get a 400")
    p.add_argument("--history-tokens", type=int, default=1 << 22,
                   help="token-exact histories: token ids of generated turns kept so that later prompts hold "
                        "them as produced (0: off; docs/SERVING.md)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: the config's / checkpoint's")
    p.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    s = p.add_argument_group("security (docs/SERVING.md, 'Security')")
    s.add_argument("--api-key", default=None,
                   help="every route but /health needs 'Authorization: Bearer KEY' (default: $TREERL_API_KEY; "
                        "prefer the variable: a command line is visible to other users)")
    s.add_argument("--weights-root", metavar="DIR", default=None,
                   help="/update_weights_from_disk reads only under DIR (default: the run directory of --weights, "
                        "or --weights itself; without either, reloads are refused)")
    s.add_argument("--max-n", type=int, default=128, help="cap on a request's n")
    s.add_argument("--max-tokens-limit", type=int, default=None, help="cap on a request's max_tokens (default: the context)")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer text prompts get 400 before tokenizing (default: 2 x context x longest token)")
    s.add_argument("--max-queued", type=int, default=1024,
                   help="generation requests waiting or running at once; more get 429 with Retry-After")
    p.add_argument("--lora", metavar="PATH", help="a LoRA adapter directory (a LoRA run's checkpoint model/) to apply "
                                                  "to the model, merged once at load")


def parser() -> argparse.ArgumentParser:
    from .config import describe_sections

    p = argparse.ArgumentParser(prog="treerl", description="RL post-training over prefix trees: every shared token computed once.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    t = sub.add_parser(
        "train", help="train from a YAML config with key=value overrides",
        description="Train a model with RL (optionally after SFT) from a YAML config.",
        epilog="config sections and keys (override any as section.key=value):\n" + describe_sections(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("config", nargs="?", help="YAML config file (optional: defaults otherwise)")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.steps=100")
    t.add_argument("--resume", metavar="CHECKPOINT", help="a checkpoint, or a run directory (its newest checkpoint)")
    t.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    t.add_argument("--overwrite", action="store_true",
                   help="start over in a train.out_dir that holds a run, deleting its outputs (metrics, rollouts, "
                        "checkpoints, plots)")
    t.set_defaults(func=cmd_train)
    e = sub.add_parser("eval", help="held-out accuracy of a checkpoint",
                       description="Greedy accuracy of a checkpoint on its task's held-out problems.")
    e.add_argument("checkpoint", help="a checkpoint directory, or a run directory")
    e.add_argument("overrides", nargs="*", help="section.key=value overrides (e.g. task.kwargs=...)")
    e.add_argument("-n", type=int, default=None, help="number of held-out problems")
    e.add_argument("--device", default="cpu")
    e.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    e.set_defaults(func=cmd_eval)
    b = sub.add_parser("bench", help="tree-vs-flat engine benchmark", add_help=False,
                       description="Tree-vs-flat engine benchmark (see `treerl bench --help`).")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    v = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model (a checkpoint, or built from a config) as an OpenAI-compatible "
                                   "HTTP server with token ids, logprobs and weight versions (README, 'Agents').")
    _serve_arguments(v)
    v.set_defaults(func=cmd_serve)
    x = sub.add_parser("export", help="write a LoRA run's checkpoint as a full Hugging Face model",
                       description="Merge a LoRA run's adapter into its base model and write a Hugging Face model "
                                   "directory (README, 'LoRA').")
    x.add_argument("--merge-lora", dest="run", metavar="RUN", required=True,
                   help="a checkpoint of a run with model.lora, or its run directory (the newest checkpoint)")
    x.add_argument("out", help="the output directory")
    x.set_defaults(func=cmd_export)
    s = sub.add_parser("tree-stats", help="prefix-sharing statistics of a rollouts JSONL file",
                       description="Sharing statistics of rollouts (one JSON object per line with token_ids; "
                                   "lines with the same 'step' form one batch).")
    s.add_argument("rollouts", type=Path)
    s.add_argument("--plot", type=Path, help="also write depth and fan-out histograms as a PNG")
    s.set_defaults(func=cmd_tree_stats)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser: `treerl bench --help` lists its options
        return cmd_bench(argparse.Namespace(rest=argv[1:]))
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`train CONFIG --resume DIR train.steps=9`) are overrides too
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            p.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except _user_errors() as exc:
        print(f"treerl {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
