"""A user's Trainer script that knows layerstream: client.py's plain Trainer script, its
arguments read by HfArgumentParser with ``layerstream.StreamingArguments`` among them
(``--layer_stream`` streams the model the Trainer is given), and ``--load``, how the
script loads the model: ``transformers`` (AutoModelForCausalLM.from_pretrained),
``stream_model`` (the same, then ``layerstream.stream_model`` once PEFT is applied) or
``layerstream`` (``layerstream.from_pretrained``, streamed as it loads). The client matrix
runs it with ``--load transformers`` and no ``--layer_stream`` as the plain run.

    python api_client.py --model DIR --data DIR --output_dir OUT --load stream_model --use_cpu
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from clients.client import peft_config

LOADS = ("transformers", "stream_model", "layerstream")
# what the streamed runs stream with: two slots for four layers, no resident window
SLOTS = 2


@dataclass
class ClientArguments:
    model: str = field(metadata={"help": "a checkpoint directory"})
    data: str = field(metadata={"help": "a directory holding sft.jsonl"})
    peft: str = field(default="lora")
    lora_dropout: float = field(default=0.05)
    load: str = field(default="transformers", metadata={"help": f"one of {', '.join(LOADS)}"})


def main(argv=None):
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        HfArgumentParser,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    import layerstream

    parser = HfArgumentParser((ClientArguments, TrainingArguments, layerstream.StreamingArguments))
    options, args, _ = parser.parse_args_into_dataclasses(argv)
    if options.load not in LOADS:
        raise SystemExit(f"--load {options.load!r}: one of {', '.join(LOADS)}")
    set_seed(0)  # the adapters are drawn before the Trainer seeds
    device = "cpu" if args.use_cpu else "cuda"
    stream = layerstream.StreamConfig(device=device, slots=SLOTS, vram_budget=None)
    if options.load == "layerstream":
        model = layerstream.from_pretrained(options.model, stream=stream)
    else:
        model = AutoModelForCausalLM.from_pretrained(options.model)
    model = get_peft_model(model, peft_config(options.peft, options.model, options.lora_dropout))
    if options.load == "stream_model":
        layerstream.stream_model(model, stream)
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    rows = [json.loads(line) for line in (Path(options.data) / "sft.jsonl").open()]
    tokens = Dataset.from_list(rows).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=48), remove_columns=["text"]
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=tokens, data_collator=collator)
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
