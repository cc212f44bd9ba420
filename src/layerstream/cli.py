"""The ``layerstream`` command."""

from __future__ import annotations

import argparse
import sys


def _add_plan_parser(sub) -> argparse.ArgumentParser:
    from .config import int_or_auto
    from .plan import DEFAULT_BANDWIDTH_GBPS, QUANTIZATIONS

    plan = sub.add_parser(
        "plan", help="predict GPU memory, host RAM and copy time of streamed LoRA training",
        description="Predict whether streamed LoRA training of a model fits a GPU, from its "
                    "config alone (no weights, no GPU). Exits 0 when it fits, 1 when it does not.")
    plan.add_argument("--model", required=True,
                      help="hub id, local model directory, or path to a config.json file")
    plan.add_argument("--vram", required=True, help="GPU memory budget, e.g. 16GiB, 24GB, 80GiB")
    plan.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    plan.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    plan.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                      help="frozen weights as stored: none (--dtype) or nf4 (bitsandbytes)")
    plan.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                      help="weight and compute dtype (default bfloat16)")
    plan.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r (default 16; 0: none)")
    plan.add_argument("--lora-targets", default="all-linear",
                      help="PEFT target_modules: all-linear (default) or names, e.g. q_proj,v_proj")
    plan.add_argument("--slots", type=int, default=None,
                      help="GPU slots (default: the most in 2..8 that fit)")
    plan.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH_GBPS,
                      help=f"pinned host->device GB/s (default {DEFAULT_BANDWIDTH_GBPS:g}, measured "
                           "on the team's H200; pass your own)")
    plan.add_argument("--reserve", default="1GiB",
                      help="GPU memory kept free for the CUDA context and allocator (default 1GiB)")
    plan.add_argument("--stream-embeddings", action="store_true",
                      help="keep the input embedding and head in host memory "
                           "(StreamConfig(stream_embeddings=True)); the head is copied in for the loss")
    plan.add_argument("--backward-slots", type=int_or_auto, default=0,
                      help="extra slots used only outside the loss (default 0; auto: as many as the "
                           "loss's memory holds, as StreamConfig(backward_slots='auto') takes with "
                           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    return plan


def _run_plan(args, parser: argparse.ArgumentParser) -> int:
    from .plan import format_plan, load_config, make_plan, parse_bytes

    try:
        vram = parse_bytes(args.vram)
        reserve = parse_bytes(args.reserve)
        config = load_config(args.model)
        plan = make_plan(config, seq=args.seq, batch=args.batch, vram_bytes=vram,
                         quantization=args.quantization, dtype=args.dtype,
                         lora_rank=args.lora_rank, slots=args.slots,
                         bandwidth_gbps=args.bandwidth, lora_targets=args.lora_targets,
                         reserve_bytes=reserve, stream_embeddings=args.stream_embeddings,
                         backward_slots=None if args.backward_slots == "auto" else args.backward_slots)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))  # exits with status 2
    print(format_plan(plan))
    return 0 if plan.fits else 1


def _add_run_parser(sub) -> argparse.ArgumentParser:
    from .config import int_or_auto

    run = sub.add_parser(
        "run", help="run an unchanged training script with every Trainer's model streamed",
        description="Run SCRIPT as __main__ with every transformers.Trainer (and subclass) streaming "
                    "the model it is given. Options before SCRIPT are layerstream's; the rest are "
                    "the script's own.")
    run.add_argument("--slots", type=int_or_auto, default="auto", help="GPU slots, >= 2 (default: auto)")
    run.add_argument("--prefetch", type=int_or_auto, default="auto",
                     help="layers copied ahead, >= 1 and < slots (default: auto, slots - 1)")
    run.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    run.add_argument("--stream-embeddings", action="store_true",
                     help="keep the input embedding and head in host memory too")
    run.add_argument("--backward-slots", type=int_or_auto, default="auto",
                     help="extra slots used only outside the loss, >= 0 (default: auto)")
    run.add_argument("script")
    return run


def _run_script(args, rest) -> int:
    import runpy

    from .config import StreamConfig
    from .integrations import trainer as trainer_integration

    config = StreamConfig(slots=args.slots, prefetch=args.prefetch, device=args.device,
                          stream_embeddings=args.stream_embeddings, backward_slots=args.backward_slots)
    saved_argv = sys.argv
    sys.argv = [args.script] + list(rest)
    trainer_integration.enable_auto_stream(config)
    try:
        runpy.run_path(args.script, run_name="__main__")
    finally:
        trainer_integration.disable_auto_stream()
        sys.argv = saved_argv
    return 0


def _add_train_parser(sub) -> argparse.ArgumentParser:
    train = sub.add_parser("train", help="LoRA/QLoRA SFT from a YAML config (TRL SFTTrainer), streamed",
                           description="Train as CONFIG says. The config is checked whole before "
                                       "anything is built or written.")
    train.add_argument("config", help="a YAML file, e.g. configs/default.yaml")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value (repeatable), e.g. --set training.max_steps=10")
    return train


def _run_train(args, parser) -> int:
    from .train import TrainConfigError, load, run

    try:
        config = load(args.config, args.set)
    except TrainConfigError as exc:
        parser.error(str(exc))  # exits with status 2, before any work
    run(config)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="layerstream", description="Stream decoder layers from host memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="LoRA-train a tiny streamed model on the embedded data (no download)",
                   add_help=False)
    plan_parser = _add_plan_parser(sub)
    _add_run_parser(sub)
    train_parser = _add_train_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":  # everything after the script belongs to the script
        script_at = next((i for i, a in enumerate(argv[1:], 1) if a.endswith(".py")), len(argv))
        args = parser.parse_args(argv[: script_at + 1])
        return _run_script(args, argv[script_at + 1:])
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(rest)
    elif args.command == "train":
        if rest:
            train_parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _run_train(args, train_parser)
    elif args.command == "plan":
        if rest:
            plan_parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _run_plan(args, plan_parser)
    return 0


if __name__ == "__main__":
    sys.exit(main())
