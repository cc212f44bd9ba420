"""One message per job: under a launcher of several processes (Accelerate, torchrun) a warning
about what every rank shares is said by the main process alone, and a fact of one rank by that
rank with its rank in front; every user message of the package goes through that logger."""

import ast
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from layerstream.system.log import get_logger, is_main_process, process_rank

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "layerstream"

# each rank streams a tiny model with debug checksums (a warning every rank would say), then
# its layer store's page-locking is refused (a fact of this rank)
RANK_CODE = """
import os, sys
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from layerstream.system import cudart
from layerstream.tiers import store
from layerstream.api import stream_model
from layerstream.errors import PinError

world = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(os.environ["RANK"]), world_size=world)
shape = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, num_hidden_layers=2, **shape)).requires_grad_(False)
stream_model(model, device="cpu", slots=2, prefetch=1, vram_budget=None, checksum=True)

def refuse(*args, **kwargs):
    raise PinError("cudaHostRegister failed with CUDA error 2")

cudart.register_host = refuse
store.HostStore(4096, pin=True)._new_arena(4096, pin=True)
dist.barrier()
dist.destroy_process_group()
"""


def _run_ranks(tmp_path, world: int = 2) -> str:
    """Run RANK_CODE in ``world`` processes of one gloo group, started as torchrun starts them
    (RANK, WORLD_SIZE, LOCAL_RANK); their stderr, together."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    started = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(RANK_CODE), str(tmp_path / "rendezvous")],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    said = []
    for process in started:
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        said.append(err)
    return "".join(said)


def _count(text: str, phrase: str) -> int:
    return sum(phrase in line for line in text.splitlines())


def test_two_gloo_ranks_say_a_shared_warning_once_and_a_rank_fact_once_each_with_its_rank(tmp_path):
    """Both ranks' lines are counted (the fact of each rank is there twice), and the warning
    every rank reaches is there once."""
    said = _run_ranks(tmp_path)
    assert _count(said, "debug checksums on") == 1, said
    assert _count(said, "could not page-lock host memory for the layer store") == 2, said
    assert _count(said, "[rank 0] layerstream: could not page-lock") == 1, said
    assert _count(said, "[rank 1] layerstream: could not page-lock") == 1, said


def test_the_rank_comes_from_the_launchers_variables(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert process_rank() is None and is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert process_rank() == 3 and not is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert process_rank() is None and is_main_process()


def test_a_rank_other_than_the_first_says_only_its_own_facts(monkeypatch, caplog):
    logger = get_logger("layerstream.test")
    with caplog.at_level(logging.INFO, logger="layerstream.test"):
        logger.warning("shared %s", "fact")  # a process of its own says everything, without a rank
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
        logger.warning("shared %s", "fact")
        logger.info("shared note")
        logger.warning("own %s", "fact", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["shared fact", "[rank 1] own fact"]


# modules whose printed lines are a command's output, not messages about the run
COMMAND_OUTPUT = {"commands/flags.py", "commands/plan.py", "commands/disk.py", "commands/demo.py"}


def _inside(path: Path) -> str:
    """The path of a file relative to the package (the file's name for a file outside it)."""
    return path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name


def _message_calls(path: Path):
    """(line, what) of each message that bypasses ``log.get_logger``: a logger taken from
    ``logging.getLogger``, ``warnings.warn``, ``print``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if (func.value.id, func.attr) in {("logging", "getLogger"), ("warnings", "warn")}:
                yield node.lineno, f"{func.value.id}.{func.attr}"
        elif isinstance(func, ast.Name) and func.id == "print" and _inside(path) not in COMMAND_OUTPUT:
            yield node.lineno, "print"


def test_every_message_of_the_package_goes_through_the_rank_aware_logger():
    found = [
        f"{path.relative_to(ROOT)}:{line} {what}"
        for path in PACKAGE.rglob("*.py")
        if _inside(path) != "system/log.py"
        for line, what in _message_calls(path)
        if not (_inside(path) == "commands/demo.py" and what == "logging.getLogger")  # the demo quiets other libraries
    ]
    assert not found, found


def test_the_scan_finds_a_message_that_bypasses_the_logger(tmp_path):
    """Negative control: each kind of bypass is found."""
    module = tmp_path / "module.py"
    module.write_text('import logging, warnings\nlogging.getLogger("x").warning("a")\nwarnings.warn("b")\nprint("c")\n')
    assert [what for _, what in sorted(_message_calls(module))] == ["logging.getLogger", "warnings.warn", "print"]


def test_a_logger_of_rank_facts_says_each_on_every_rank_with_its_rank(monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="layerstream.test"):
        get_logger("layerstream.test", main_process_only=False).warning("probed %d", 3)
        get_logger("layerstream.test", main_process_only=False).info("shared", main_process_only=True)
    assert [r.getMessage() for r in caplog.records] == ["[rank 1] probed 3"]
