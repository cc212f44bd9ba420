"""``layerstream plan``: will a streamed LoRA/QLoRA run fit, and how fast can it copy?"""

from __future__ import annotations

import argparse

from .flags import add_setting_flags, flag_name


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "plan",
        help="predict GPU memory, host RAM and copy time of streamed LoRA training",
        description="Predict whether streamed LoRA training of a model fits a GPU, from its "
        "config alone (no weights, no GPU). Exits 0 when it fits, 1 when it does not.",
    )


def add_arguments(plan: argparse.ArgumentParser) -> None:
    """The planner's own flags (the model, the step's shape, LoRA, the host-device bandwidth)
    and, from StreamConfig's settings, the flags of the settings a plan takes (same names,
    help and defaults as ``layerstream run``'s: ``request.PLAN_SETTINGS``)."""
    from ..plan import DEFAULT_BANDWIDTH_GBPS, QUANTIZATIONS
    from ..plan.request import PLAN_SETTINGS

    plan.add_argument("--model", help="hub id, local model directory, or path to a config.json file")
    plan.add_argument(
        "--seq", type=int, default=None, help="tokens per sequence (needed unless --max-seq or --measure-disk)"
    )
    plan.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    plan.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="frozen weights as stored: none (--dtype) or nf4 (bitsandbytes)",
    )
    plan.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="weight and compute dtype (default bfloat16)",
    )
    plan.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r (default 16; 0: none)")
    plan.add_argument(
        "--lora-targets",
        default="all-linear",
        help="PEFT target_modules: all-linear (default) or names, e.g. q_proj,v_proj",
    )
    plan.add_argument(
        "--bandwidth",
        type=float,
        default=DEFAULT_BANDWIDTH_GBPS,
        help=f"pinned host->device GB/s (default {DEFAULT_BANDWIDTH_GBPS:g}, measured "
        "on the team's H200; pass your own)",
    )
    plan.add_argument(
        "--reserve", default="1GiB", help="GPU memory kept free for the CUDA context and allocator (default 1GiB)"
    )
    plan.add_argument(
        "--trl-fused-head",
        action="store_true",
        help="TRL's trainers (>= 1.16) compute the loss with their fused log-prob head: plan its "
        "footprint instead of the logits (--loss-chunk-tokens does not apply then)",
    )
    plan.add_argument(
        "--adapter-dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the LoRA weights' dtype (default float32, PEFT's; TRL's trainers make a 4-bit model's bfloat16)",
    )
    plan.add_argument(
        "--lora-dropout",
        type=float,
        default=0.0,
        help="the adapters' dropout (default 0, PEFT's; TRL's scripts default to 0.05): above 0 each "
        "adapted projection keeps its dropped input and mask for backward",
    )
    plan.add_argument(
        "--autocast",
        action="store_true",
        help="the steps run under autocast (the Trainer with bf16 or fp16; TRL's default is bf16)",
    )
    plan.add_argument(
        "--residual-dtype",
        default=None,
        choices=["float32"],
        help="the embeddings', head's and residual stream's dtype where wider than --dtype: float32 "
        "after peft's prepare_model_for_kbit_training (a plain QLoRA Trainer script)",
    )
    plan.add_argument(
        "--max-seq",
        action="store_true",
        help="also find the longest sequence that fits, with and without each long-sequence option",
    )
    plan.add_argument(
        "--host-ram",
        default=None,
        metavar="SIZE",
        help="host RAM to check the plan against, e.g. 125GiB for the machine you will train on "
        "(default: what this machine has available): the offloaded inputs grow with the sequence",
    )
    from .disk import add_disk_arguments

    add_disk_arguments(plan)
    settings = plan.add_argument_group(
        "StreamConfig settings", "planned as a run takes them (layerstream run's flags); the vram_budget is required"
    )
    add_setting_flags(settings, PLAN_SETTINGS)


def _plan_settings(args, parser: argparse.ArgumentParser) -> dict:
    """The setting flags' values as StreamConfig takes them (``config.parse_setting``, as
    ``layerstream run`` parses its own), with both budgets in bytes."""
    from ..config import parse_setting
    from ..decisions.disk import resolve_host_budget
    from ..plan.request import PLAN_SETTINGS
    from ..tiers.store import host_memory

    values = {name: parse_setting(name, getattr(args, name), flag_name(name)) for name in PLAN_SETTINGS}
    if not isinstance(values["vram_budget"], int):
        parser.error(
            f"--vram-budget {args.vram_budget}: give the GPU memory to plan for, e.g. 16GiB (the plan measures "
            "no GPU, and needs a budget)"
        )
    if values["host_budget"] == "auto":
        values["host_budget"] = resolve_host_budget("auto", host_memory())
    return values


def run(args, parser: argparse.ArgumentParser) -> int:
    from ..plan import (
        comparison,
        format_comparison,
        format_host_check,
        format_plan,
        load_config,
        make_plan,
        max_seq,
        request_for,
    )
    from ..plan.long_settings import LONG_ORDER, OFF, decide_for, plan_line
    from ..tiers.store import host_memory
    from ..units import parse_bytes
    from .disk import disk_tier, format_disk_term, measure_disk

    if args.measure_disk:
        return measure_disk(args, parser)
    if not args.model:
        parser.error("the following arguments are required: --model")
    if args.seq is None and not args.max_seq:
        parser.error("give --seq (tokens per sequence), or --max-seq to find the longest that fits")
    if not 0 <= args.lora_dropout < 1:
        parser.error(f"--lora-dropout {args.lora_dropout:g} must be in [0, 1)")
    try:
        settings = _plan_settings(args, parser)
        config = load_config(args.model)
        request = request_for(
            settings,
            settings["vram_budget"],
            config=config,
            seq=args.seq or 1,
            batch=args.batch,
            quantization=args.quantization,
            dtype=args.dtype,
            lora_rank=args.lora_rank,
            lora_targets=args.lora_targets,
            bandwidth_gbps=args.bandwidth,
            reserve_bytes=parse_bytes(args.reserve),
            trl_fused_head=args.trl_fused_head,
            adapter_dtype=args.adapter_dtype,
            lora_dropout=args.lora_dropout > 0,
            autocast=args.autocast,
            residual_dtype=args.residual_dtype,
        )
        longest = max_seq(request) if args.max_seq else None
        request = request.replace(seq=args.seq if args.seq is not None else max(longest, 1))
        plan = make_plan(request)
        rows = comparison(request, args.max_seq)
        # what a run's defaults turn on for the settings not given a value
        unset = {name: "auto" for name in LONG_ORDER if getattr(request, name) in ("auto", OFF[name])}
        auto = plan_line(decide_for(request.replace(**unset), request.vram_bytes), args.batch, request.seq)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))  # exits with status 2
    print(format_plan(plan))
    memory = _host_ram(args, parser) or host_memory()
    machine = "this machine" if args.host_ram is None else f"--host-ram {args.host_ram}"
    store = None  # every layer in host RAM
    if settings["host_budget"] is not None:  # a disk tier: the host holds its store instead
        try:
            term, params, store = disk_tier(args, config, plan, settings["host_budget"])
        except ValueError as exc:
            parser.error(str(exc))
        print(format_disk_term(args, term, params, settings["host_budget"]))
    if memory is not None:
        # where the host is what bounds the length: the longest it holds
        checked = plan if store is None else store(plan)
        held = None if checked.host_holds(*memory) else max_seq(request, host=memory, store=store)
        print(format_host_check(checked, memory, held, machine, disk=store is not None))
        if longest is not None and held is None and (held := max_seq(request, host=memory, store=store)) < longest:
            print(f"  of the longest that fits the GPU ({longest} tokens), the host holds {held}")
    print(_decode_lines(args, config, plan, request))
    print()
    print(format_comparison(rows, request.seq, args.batch))
    print(auto)
    if longest is not None:
        print(f"\nlongest sequence that fits as given: {longest} tokens at batch {args.batch}")
        return 0 if longest > 0 else 1
    return 0 if plan.fits else 1


def _host_ram(args, parser: argparse.ArgumentParser):
    """--host-ram as (available, total) bytes, as ``host_memory`` gives this machine's; None
    when not given."""
    from ..units import parse_bytes

    if args.host_ram is None:
        return None
    if args.host_ram.strip().isdigit():  # bytes, surely meant as GiB
        parser.error(f"--host-ram {args.host_ram}: give a unit, e.g. {args.host_ram.strip()}GiB")
    try:
        size = parse_bytes(args.host_ram)
    except ValueError as exc:
        parser.error(f"--host-ram {args.host_ram}: {exc}")
    return size, size


def _decode_lines(args, config, plan, request) -> str:
    from ..decisions.schedule import spread_resident
    from ..plan import layer_shapes, parse_dtype
    from ..plan.decode import active_params, decode_term, routed_bytes
    from ..plan.report import format_decode_term

    shapes = layer_shapes(config)
    routed = routed_bytes(shapes, parse_dtype(request.dtype).itemsize)
    params = active_params(shapes)
    term = decode_term(plan.layer_bytes, plan.slots, plan.bandwidth_gbps, params, args.tflops, routed, args.batch)
    windowed = None
    if plan.window_layers:
        kept = frozenset(spread_resident(plan.num_layers, plan.window_layers))
        windowed = decode_term(
            plan.layer_bytes, plan.slots, plan.bandwidth_gbps, params, args.tflops, routed, args.batch, kept
        )
    return format_decode_term(plan, term, args.batch, windowed)
