"""Explanations and threads: one model explained from several threads gives the one-thread maps;
plain inference in other threads (same model, other models) is never affected; nothing is left
changed, process flags included.

Every thread of a test starts at one barrier, and the interpreter switches threads every
microsecond while they run, so explanations and plain forwards interleave operation by
operation. Loops are bounded in count; the bystanders stop when the explainers are done.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable, Dict, List

import pytest
import torch
from torch import nn

from captum_transformers.methods.catalog import CAPTUM_BASELINES, METHOD_FACTORIES, METHOD_NAMES
from hf_models import CASES
from tiny_models import EncoderClassifier
from restore import assert_same, snapshot

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

ROUNDS = 2          # attribute calls per explaining thread and method
BYSTANDER_CALLS = 400  # upper bound on a bystander's plain forwards




def _hf(seed=0):
    model = CASES["bert"].model(seed=seed)
    inputs, kwargs = CASES["bert"].inputs()
    return model, inputs, kwargs


def _timm(seed=0):
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    return model.eval(), torch.randn(3, 3, 32, 32), {}


def _torch_mha(seed=0):
    ids = torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(seed))
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    return EncoderClassifier(seed).eval(), ids, {"key_padding_mask": padding}


def _inline_attention(seed=0):
    import transformers

    torch.manual_seed(seed)
    model = transformers.VisualBertForVisualReasoning(transformers.VisualBertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, visual_embedding_dim=8,
        vocab_size=50, num_labels=3))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 50, (3, 6), generator=generator)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0
    return model.eval(), ids, {"attention_mask": mask, "visual_embeds": torch.randn(3, 4, 8, generator=generator)}


MODELS = {"huggingface": _hf, "timm": _timm, "torch_mha": _torch_mha, "inline_attention": _inline_attention}
TARGETS = [0, 1, 2]


@pytest.fixture(autouse=True)
def _interleave():
    """Switch threads as often as the interpreter can, for the duration of a test."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def _run_together(*jobs: Callable[[], None]) -> None:
    """Start every job at one barrier; re-raise the first exception any of them raised."""
    barrier = threading.Barrier(len(jobs))
    errors: List[BaseException] = []

    def run(job):
        try:
            barrier.wait(timeout=60)
            job()
        except BaseException as error:  # noqa: BLE001 - reported to the test thread below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
        assert not thread.is_alive(), "a thread did not finish (deadlock?)"
    if errors:
        raise errors[0]


def _process_flags():
    return (torch.backends.mha.get_fastpath_enabled(), torch.is_grad_enabled(),
            torch._C._is_torch_function_mode_enabled())


def _config_state(model: nn.Module):
    return [(type(m.config), m.config._attn_implementation_internal) for m in model.modules()
            if hasattr(getattr(m, "config", None), "_attn_implementation_internal")]


def _attribute(explainer, inputs, kwargs):
    # Captum's own methods give pixel maps for float inputs (no tokens there).
    tokens = not (type(explainer).__name__.startswith("Captum") and inputs.is_floating_point())
    return explainer.attribute(inputs, target=TARGETS, forward_kwargs=kwargs, return_tokens=tokens)


def _applies(method, model, inputs):
    """Captum's baselines read token ids at get_input_embeddings(), which the plain encoder lacks."""
    return method not in CAPTUM_BASELINES or inputs.is_floating_point() or hasattr(model, "get_input_embeddings")


def _plain(model, inputs, kwargs, grad: bool):
    with torch.set_grad_enabled(grad):
        output = model(inputs, **kwargs)
    output = output if isinstance(output, torch.Tensor) else output[0]
    return output.detach().clone()


@pytest.mark.parametrize("adapter", sorted(MODELS))
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_two_threads_explaining_one_model_get_the_one_thread_maps(adapter, method):
    model, inputs, kwargs = MODELS[adapter]()
    if not _applies(method, model, inputs):
        pytest.skip(f"{method} needs get_input_embeddings() for token ids")
    explainer = METHOD_FACTORIES[method](model)
    expected = _attribute(explainer, inputs, kwargs)
    before, configs, flags = snapshot(model), _config_state(model), _process_flags()
    results: Dict[int, list] = {0: [], 1: []}

    def explain(slot):
        def job():
            for _ in range(ROUNDS):
                results[slot].append(_attribute(explainer, inputs, kwargs))
        return job

    _run_together(explain(0), explain(1))
    for maps in results[0] + results[1]:
        torch.testing.assert_close(maps, expected, rtol=0, atol=0)
    assert_same(before, snapshot(model))
    assert _config_state(model) == configs and _process_flags() == flags


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("adapter", sorted(MODELS))
def test_plain_inference_in_other_threads_is_bit_identical_while_explaining(adapter, grad):
    model, inputs, kwargs = MODELS[adapter]()
    other, other_inputs, other_kwargs = MODELS[adapter](seed=1)
    clean = _plain(model, inputs, kwargs, grad)
    clean_other = _plain(other, other_inputs, other_kwargs, grad)
    before, configs, flags = snapshot(model), _config_state(model), _process_flags()
    explainers = [METHOD_FACTORIES[name](model) for name in METHOD_NAMES if _applies(name, model, inputs)]
    done = threading.Event()
    seen = {"same": 0, "other": 0, "flags": set()}

    def explain():
        try:
            for explainer in explainers:
                _attribute(explainer, inputs, kwargs)
        finally:
            done.set()

    def bystander(name, target_model, target_inputs, target_kwargs, reference):
        def job():
            for _ in range(BYSTANDER_CALLS):
                output = _plain(target_model, target_inputs, target_kwargs, grad)
                seen["flags"].add(torch.backends.mha.get_fastpath_enabled())
                torch.testing.assert_close(output, reference, rtol=0, atol=0,
                                           msg=lambda m: f"{name} model's plain output changed: {m}")
                seen[name] += 1
                if done.is_set():
                    break
        return job

    _run_together(explain, bystander("same", model, inputs, kwargs, clean),
                  bystander("other", other, other_inputs, other_kwargs, clean_other))
    assert seen["same"] > 1 and seen["other"] > 1
    assert seen["flags"] == {flags[0]}  # the process-wide fast-path flag never moved
    assert_same(before, snapshot(model))
    assert _config_state(model) == configs and _process_flags() == flags


def test_two_threads_explaining_two_encoders_leave_a_third_model_and_the_fast_path_alone():
    first, second, third = (_torch_mha(seed) for seed in (0, 1, 2))
    clean = _plain(*third, grad=False)
    flags = _process_flags()
    done = [threading.Event(), threading.Event()]
    fast_path_seen = set()

    def explain(index, case):
        def job():
            try:
                model, inputs, kwargs = case
                for name in ("generic-attention", "attn-lrp", "transformer-relevance"):
                    _attribute(METHOD_FACTORIES[name](model), inputs, kwargs)
            finally:
                done[index].set()
        return job

    def bystander():
        for _ in range(BYSTANDER_CALLS):
            fast_path_seen.add(torch.backends.mha.get_fastpath_enabled())
            torch.testing.assert_close(_plain(*third, grad=False), clean, rtol=0, atol=0)
            if all(event.is_set() for event in done):
                break

    _run_together(explain(0, first), explain(1, second), bystander)
    assert fast_path_seen == {True}
    assert _process_flags() == flags


class SharedEncoderClassifier(nn.Module):
    """Another classifier around the *same* encoder instance as a given EncoderClassifier."""

    def __init__(self, encoder: nn.TransformerEncoder, seed: int = 5):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(20, 16)
        self.encoder = encoder
        self.head = nn.Linear(16, 3)

    def forward(self, ids, key_padding_mask=None):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=key_padding_mask)[:, 0])


@pytest.mark.parametrize("method", ["generic-attention", "attn-lrp", "transformer-relevance"])
def test_two_models_sharing_an_encoder_explained_from_two_threads(method):
    first, inputs, kwargs = _torch_mha()
    second = SharedEncoderClassifier(first.encoder).eval()
    explainers = [METHOD_FACTORIES[method](model) for model in (first, second)]
    expected = [_attribute(explainer, inputs, kwargs) for explainer in explainers]
    before = [snapshot(first), snapshot(second)]
    results: Dict[int, list] = {0: [], 1: []}

    def explain(slot):
        def job():
            for _ in range(ROUNDS):
                results[slot].append(_attribute(explainers[slot], inputs, kwargs))
        return job

    _run_together(explain(0), explain(1))
    for slot in (0, 1):
        for maps in results[slot]:
            torch.testing.assert_close(maps, expected[slot], rtol=0, atol=0)
    assert_same(before[0], snapshot(first))
    assert_same(before[1], snapshot(second))


def test_a_captured_hf_config_answers_per_thread_and_pickles_as_its_own_class():
    import copy
    import pickle

    from captum_transformers.model_state import patching

    model, _, _ = _hf()
    config = model.config
    original_class, stored = type(config), config._attn_implementation
    seen = {}

    def other_thread():
        seen["implementation"] = config._attn_implementation

    with patching.hf_attention_implementation(model, "captum_transformers"):
        assert config._attn_implementation == "captum_transformers"
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(timeout=60)
        assert type(pickle.loads(pickle.dumps(config))) is original_class
        assert type(copy.deepcopy(config)) is original_class
    assert seen["implementation"] == stored
    assert type(config) is original_class and config._attn_implementation == stored


@pytest.mark.parametrize("adapter", ["huggingface", "timm", "torch_mha"])
def test_a_users_propagation_block_and_an_explanation_in_another_thread_do_not_interleave(adapter):
    """Patches restore what they found, so contexts on one model must exit in reverse order: an
    explanation waits while another thread is inside ``adapter.propagation(model, rules)``."""
    from captum_transformers import RuleSet, get_adapter

    model, inputs, kwargs = MODELS[adapter]()
    explainer = METHOD_FACTORIES["conservative-lrp"](model)
    expected = _attribute(explainer, inputs, kwargs)
    before = snapshot(model)
    inside, order, results = threading.Event(), [], []

    def users_block():
        with get_adapter(model).propagation(model, RuleSet.AH_LN):
            inside.set()
            for _ in range(50):  # stay inside long enough for the explanation to try to start
                if order:
                    break
                threading.Event().wait(0.01)
            order.append("user block left")

    def explanation():
        inside.wait(5)
        results.append(_attribute(explainer, inputs, kwargs))
        order.append("explanation done")

    _run_together(users_block, explanation)
    assert order == ["user block left", "explanation done"]
    torch.testing.assert_close(results[0], expected, rtol=0, atol=0)
    assert_same(before, snapshot(model))
