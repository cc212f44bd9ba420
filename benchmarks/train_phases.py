"""Where `layerstream train configs/default.yaml` spends its time, phase by phase, in one process:
the imports, reading the YAML, building and streaming the model, TRL's dataset preparation, the
training steps and saving. Run from the repository root; extra arguments go to the command
(e.g. `--set stream.device=cpu`). The figures in README.md came from two idle cores:

    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 taskset -c 0,1 python benchmarks/train_phases.py
"""

import sys
import time

START = time.perf_counter()
marks = [("start", START)]


def mark(name: str) -> None:
    marks.append((name, time.perf_counter()))


import torch  # noqa: E402

mark("import torch")
import peft  # noqa: E402,F401
import transformers  # noqa: E402

mark("import transformers, peft")
import datasets  # noqa: E402
import trl  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402
from trl import SFTTrainer  # noqa: E402

mark("import trl, datasets, SFTTrainer")
from layerstream.commands import cli, train_config  # noqa: E402
from layerstream.system.versions import versions  # noqa: E402

steps = []


class _Steps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        steps.append(time.perf_counter())


def _timed(function, before=None, after=None, add_callback=False):
    def wrapped(*args, **kwargs):
        if before:
            mark(before)
        result = function(*args, **kwargs)
        if add_callback:
            args[0].add_callback(_Steps())
        if after:
            mark(after)
        return result

    return wrapped


train_config.load = _timed(train_config.load, after="read and check the YAML")
SFTTrainer.__init__ = _timed(
    SFTTrainer.__init__,
    before="build and stream the model",
    after="SFTTrainer(...): prepare the dataset",
    add_callback=True,
)
Trainer.train = _timed(Trainer.train, after="trainer.train(): 60 steps and two evaluations")
argv = [
    "train",
    "configs/default.yaml",
    "--set",
    "training.output_dir=/tmp/train-phases",
    "--set",
    "training.disable_tqdm=true",
]
cli.main(argv + sys.argv[1:])
mark("save the adapter and the state")
for (_, before), (name, at) in zip(marks, marks[1:]):
    print(f"{at - before:7.2f} s  {name}")
print(f"{marks[-1][1] - START:7.2f} s  in this process (the interpreter's own start not counted)")
begin = [at for name, at in marks if name.startswith("SFTTrainer")][0]
gaps = [b - a for a, b in zip([begin] + steps[:-1], steps)]
rest = sorted(gaps[5:])
print(
    "first 5 steps:",
    " ".join(f"{g:.2f}" for g in gaps[:5]),
    f"s; steps 6-{len(gaps)}: median {rest[len(rest) // 2]:.3f} s",
)
print(f"torch threads {torch.get_num_threads()}; " + ", ".join(f"{k} {v}" for k, v in versions().items()))
print(f"trl {trl.__version__}, datasets {datasets.__version__}, transformers {transformers.__version__}")
