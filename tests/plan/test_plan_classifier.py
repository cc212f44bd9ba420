"""A sequence classifier (TRL's RewardTrainer trains one) is planned with its own head: its
``score`` has num_labels outputs, so its logits are that narrow, it holds no vocabulary-wide
head, and no loss of it is chunked. Planned as the causal LM its config also describes, a
reward model's step at a few thousand tokens was refused for logits it never makes."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import layerstream
from layerstream.errors import StreamingError
from layerstream.plan import model as plan_model
from layerstream.plan import plan_for_model

from tiny import tiny_config

VOCAB, TOKENS = 32000, 2048


def _reward_model(seed=0):
    torch.manual_seed(seed)
    config = tiny_config("llama", 4, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, head_dim=16, num_labels=1)
    model = AutoModelForSequenceClassification.from_config(config)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="SEQ_CLS"))
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # non-zero B: every adapter's gradients count in the comparison
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def test_a_classifier_is_planned_with_its_score_head_not_the_vocabulary():
    reward = _reward_model()
    assert plan_model.head_outputs_of(reward) == 1  # through PEFT's copy of the score
    lm = AutoModelForCausalLM.from_config(reward.config)
    assert plan_model.head_outputs_of(lm) is None
    classifier, causal = plan_for_model(reward, TOKENS, 1, slots=2), plan_for_model(lm, TOKENS, 1, slots=2)
    assert classifier.vocab_size == 1 and causal.vocab_size == VOCAB
    assert classifier.loss_bytes < TOKENS * 64  # a handful of copies of tokens x 1 float32 logits
    assert causal.loss_bytes >= TOKENS * VOCAB * 4  # control: the causal LM's own logits
    lm_head, score = VOCAB * 64 * 4, 64 * 4
    assert causal.resident_bytes - classifier.resident_bytes == lm_head - score
    streamed = plan_for_model(reward, TOKENS, 1, slots=2, stream_embeddings=True)
    assert streamed.head_copy_bytes == 0 and streamed.ends_copy_bytes_per_step == TOKENS * 64 * 4


def test_a_reward_model_step_under_a_budget_runs_and_equals_resident():
    """1.6 GiB holds this step (the planner's 1 GiB reserve and a small model); counted with
    a vocabulary-wide head's logits it did not. Control: planned as a causal LM, refused."""
    resident, streamed = _reward_model(), _reward_model()
    layerstream.stream_model(streamed, slots=2, vram_budget="1.6GiB", device="cpu")
    ids = torch.randint(3, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([1.0])
    losses = []
    for model in (resident, streamed):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    assert torch.equal(losses[0][0], losses[1][0])
    assert all(torch.equal(a, b) for a, b in zip(losses[0][1], losses[1][1]))
    summary = layerstream.get_runtime(streamed).summary()
    assert "loss_chunk_tokens auto stays off" in summary


def test_planned_as_a_causal_lm_the_same_step_is_refused(monkeypatch):
    monkeypatch.setattr(plan_model, "head_outputs_of", lambda model: None)
    streamed = _reward_model()
    layerstream.stream_model(streamed, slots=2, vram_budget="1.6GiB", device="cpu")
    ids = torch.randint(3, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    with pytest.raises(StreamingError, match="does not fit vram_budget"):
        streamed(input_ids=ids, labels=torch.tensor([1.0]))


def _request(model, budget, **settings):
    from layerstream.plan.model import model_plan_request

    return model_plan_request(model, 8192, 1, budget, slots=2, **settings)


def test_advice_for_a_classifier_offers_no_loss_chunk_and_streams_its_embedding_alone():
    """The advice of a classifier that does not fit: no --loss-chunk-tokens (no causal LM loss
    to chunk), and --stream-embeddings moves the embedding alone, with no head copied in.
    Control: the causal LM of the same config is offered both, its head copied twice."""
    from layerstream.plan import make_plan

    reward = _reward_model()
    lm = AutoModelForCausalLM.from_config(reward.config)
    budget = 1 << 30
    classifier = " ".join(make_plan(_request(reward, budget)).advice)
    causal = " ".join(make_plan(_request(lm, budget)).advice)
    assert "--loss-chunk-tokens" not in classifier and "--loss-chunk-tokens" in causal
    embedding = f"{VOCAB * 64 * 4 / 2**20:.2f} MiB"
    assert f"the input embedding ({embedding}) stays in host memory" in classifier
    assert "copied to the GPU" not in classifier
    assert "the input embedding and head" in causal and "copied to the GPU twice per step" in causal


def test_host_memory_of_a_streamed_classifier_counts_its_embedding_as_it_moves():
    """Moving the ends copies the embedding into their store: the streamed plan's host peak
    holds it beside the store, as a causal LM's holds its largest end."""
    reward = _reward_model()
    plain, streamed = (
        plan_for_model(reward, TOKENS, 1, slots=2),
        plan_for_model(reward, TOKENS, 1, slots=2, stream_embeddings=True),
    )
    embedding, layer = VOCAB * 64 * 4, max(plain.layer_bytes)
    assert streamed.host_ram_bytes - plain.host_ram_bytes == max(layer, embedding) - layer


def test_head_outputs_must_be_a_width_or_none():
    from layerstream.plan import make_plan
    from layerstream.plan.request import PlanRequest

    config = AutoModelForCausalLM.from_config(_reward_model().config).config
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="head_outputs"):
            make_plan(PlanRequest(config, 16, 1, 1 << 34, head_outputs=bad))


def test_a_model_that_does_not_say_its_head_is_planned_as_its_causal_lm():
    class Silent(torch.nn.Module):
        def get_output_embeddings(self):
            raise NotImplementedError

    class ScoreMethod(torch.nn.Module):
        def get_output_embeddings(self):
            return None

        def score(self, x):
            return x

    assert plan_model.head_outputs_of(Silent()) is None
    assert plan_model.head_outputs_of(ScoreMethod()) == 0


def test_a_checkpoint_saved_as_a_classifier_is_planned_as_one_from_its_config():
    from layerstream.plan import make_plan
    from layerstream.plan.request import request_for

    config = _reward_model().config
    config.architectures = ["LlamaForSequenceClassification"]
    saved = make_plan(request_for({}, 1 << 34, config=config, seq=TOKENS, batch=1))
    config.architectures = ["LlamaForCausalLM"]  # control: the causal LM it started from
    causal = make_plan(request_for({}, 1 << 34, config=config, seq=TOKENS, batch=1))
    assert saved.vocab_size == 1 and causal.vocab_size == VOCAB
