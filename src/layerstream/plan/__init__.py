"""Memory planner: will a streamed LoRA/QLoRA training run fit, and how fast can it copy?

Asked with one ``PlanRequest`` (``make_plan(PlanRequest(config, seq, batch, vram_bytes,
...))``), it answers from a model's transformers config alone, before anything is downloaded or
allocated: how large each streamed layer is (the slot size and the host store), what
stays on the GPU, what the activations of one training step cost, the predicted peak
GPU memory, the host RAM needed, and how many bytes a step copies. The tensors are read
off the model transformers builds from the config on the meta device, and the adapters
off PEFT's own injection into it (``shapes``, ``lora``); meta tensors allocate nothing,
so no weights are read and CUDA is never touched.

The model of a step that the numbers follow (docs/plan.md derives each term):

- Every decoder layer streams: its frozen weights live in host arenas and are copied
  into ``slots`` GPU buffers of one largest layer each. Embeddings, the final norm, the
  head and the LoRA adapters (with their gradients and AdamW state) stay resident.
  With ``stream_embeddings`` the embedding and head live on the host too: the resident
  part is the final norm, the loss phase also holds one transient copy of the head
  weight, and a step copies the head twice (forward, backward) and the embedding rows.
- Training runs every streamed layer under activation checkpointing, so autograd keeps
  one hidden state per layer boundary, and backward recomputes one layer at a time.
- The loss (logits in fp32, their log-softmax and its gradient) and the recompute of a
  layer happen at different moments of the step, so the peak holds the larger of the two,
  on top of everything that lives for the whole step.
- Long sequences: with ``offload_activations`` the boundary states but ~2 live in host
  memory (their arena is host RAM); a chunked loss holds its fp32 logits for one chunk of
  tokens, a tiled MLP its intermediate activations for one tile (``longest`` compares the
  options and finds the longest sequence that fits).
- A step copies every layer twice (forward, then the recompute in reverse) except the
  ``slots`` layers still in slots at each forward/backward turnaround.

Any family transformers builds is planned from its own modules: the activation terms
alone (hidden size, MLP width, heads, vocabulary) read the config.
"""

from ..units import ALIGN, GiB, parse_bytes  # noqa: F401  (re-exported)
from .advice import DEFAULT_LONG_TOKENS, LONG_OPTIONS  # noqa: F401
from .long_settings import LongDecision, decide, decide_for  # noqa: F401
from .longest import comparison, max_seq, option_rows  # noqa: F401
from .lora import LoraTargets  # noqa: F401
from .memory import *  # noqa: F401,F403
from .memory import _build, _copies  # noqa: F401
from .model import model_plan_request, plan_for_model  # noqa: F401
from .planner import make_plan  # noqa: F401
from .report import format_comparison, format_host_check, format_plan, speed_hints  # noqa: F401
from .request import PlanRequest, request_for, settings_of  # noqa: F401
from .shapes import *  # noqa: F401,F403
