"""A model whose embedding and head stream computes through them or refuses: code run after
stream_model that replaces a streamed end (an untied head resized), wraps it in a layer that
reads its weight itself (PEFT's trainable tokens) or replaces its forward on the instance
(TRL's cast_lm_head_to_fp32) is refused at the next forward. The controls show what keeps
working: a tied model resized, LoRA on the ends, an instance forward that wraps the
module's own."""

import functools

import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model

import layerstream
from layerstream.api import unwrap_peft

from tiny import batch, lora_config, peft_pair, stream, tiny_model


def _streamed_pair(tied=False, **overrides):
    streamed, resident = peft_pair("llama", layers=3, tie_word_embeddings=tied, **overrides)
    stream(streamed, stream_embeddings=True)
    return streamed, resident


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_an_untied_head_resized_after_streaming_is_refused_at_the_next_forward():
    streamed, _ = _streamed_pair()
    unwrap_peft(streamed).resize_token_embeddings(128)
    with pytest.raises(layerstream.StreamingError, match="is a Linear now .*resize_token_embeddings"):
        streamed(input_ids=batch(96))


def test_a_tied_model_resized_after_streaming_still_streams_and_computes_as_resident():
    """Control: a tied head keeps its module and takes the embedding's new data."""
    streamed, resident = _streamed_pair(tied=True)
    for model in (streamed, resident):
        torch.manual_seed(3)  # the new rows are drawn at random
        unwrap_peft(model).resize_token_embeddings(128)
    runtime = layerstream.get_runtime(streamed)
    copies = runtime.stats()["head_copies"]
    ids = torch.randint(0, 128, (2, 8))
    assert torch.equal(_logits(streamed, ids), _logits(resident, ids))
    assert runtime.stats()["head_copies"] == copies + 1, "the streamed head ran"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_peft_trainable_tokens_added_after_streaming_are_refused(tied):
    """PEFT's trainable tokens compute with the embedding's (and a tied head's) weight themselves."""
    base = tiny_model("llama", layers=3, tie_word_embeddings=tied)
    stream(base, stream_embeddings=True)
    config = lora_config(target_modules=["q_proj"], trainable_token_indices=[5, 7, 50])
    model = get_peft_model(base, config)
    with pytest.raises(layerstream.StreamingError, match="wrapped by TrainableTokensWrapper"):
        model(input_ids=batch(96))


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_lora_on_a_streamed_end_added_after_streaming_computes_through_it(target):
    """Control: a LoRA layer calls its base layer, the streamed end, then adds its adapter."""
    base = tiny_model("llama", layers=3)
    resident = tiny_model("llama", layers=3)
    stream(base, stream_embeddings=True)
    config = lora_config(target_modules=[target], init_lora_weights=False)
    streamed, resident = get_peft_model(base, config), get_peft_model(resident, config)
    streamed.load_state_dict(resident.state_dict())
    ids = batch(96)
    assert torch.equal(_logits(streamed, ids), _logits(resident, ids))


def test_a_head_forward_replaced_on_the_instance_is_refused():
    """As TRL's cast_lm_head_to_fp32 does: F.linear on the head's (host) weight."""
    streamed, _ = _streamed_pair()
    head = unwrap_peft(streamed).get_output_embeddings()
    head.forward = lambda hidden: F.linear(hidden.float(), head.weight.float())
    with pytest.raises(layerstream.StreamingError, match="forward of .*lm_head was replaced on the module"):
        streamed(input_ids=batch(96))


def test_an_instance_forward_that_wraps_the_heads_own_still_streams_it():
    """Control: Accelerate's hooks leave ``functools.update_wrapper(partial(new, module), old)``."""
    streamed, resident = _streamed_pair()
    head = unwrap_peft(streamed).get_output_embeddings()
    own = head.forward
    head.forward = functools.update_wrapper(functools.partial(lambda module, x: own(x), head), own)
    runtime = layerstream.get_runtime(streamed)
    copies = runtime.stats()["head_copies"]
    ids = batch(96)
    assert torch.equal(_logits(streamed, ids), _logits(resident, ids))
    assert runtime.stats()["head_copies"] == copies + 1


def test_unstream_removes_the_check():
    streamed, _ = _streamed_pair()
    layerstream.unstream_model(streamed)
    head = unwrap_peft(streamed).get_output_embeddings()
    head.forward = lambda hidden: F.linear(hidden, head.weight)
    streamed(input_ids=batch(96))  # a plain model again: its own business
