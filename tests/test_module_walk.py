"""One walk of the modules per explanation: exclusive() publishes it, the questions read it."""
from __future__ import annotations

import threading

import torch
from torch import nn

from captum_transformers import AttnLRP
from captum_transformers.model_state import module_walk
from captum_transformers.model_state.exclusive import exclusive


def test_exclusive_publishes_the_walk_to_this_thread_only():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    seen_elsewhere = []
    with exclusive(model):
        inside = module_walk.named_modules(model)
        assert module_walk.named_modules(model) is inside           # no second walk
        assert [m for _, m in inside] == list(model.modules())
        other = threading.Thread(target=lambda: seen_elsewhere.append(module_walk.named_modules(model)))
        other.start()
        other.join()
    assert seen_elsewhere[0] is not inside                          # another thread walks for itself
    assert module_walk.named_modules(model) is not inside           # and so does this one afterwards
    assert module_walk.named_modules(model[0]) == list(model[0].named_modules())   # another model: walked


def test_an_explanation_walks_the_model_once(monkeypatch):
    """Every module the explanation's questions read comes from one walk (plus the first few
    modules of the lazy searches for a floating-point parameter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from captum_transformers.adapters import base

    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    explainer = AttnLRP(model)
    explainer.attribute(ids, target=3, return_tokens=True)        # probes and caches warm up
    count = len(list(model.modules()))
    yielded = []
    real = nn.Module.named_modules

    def counting(self, *args, **kwargs):
        for item in real(self, *args, **kwargs):
            if self is model:
                yielded.append(item)
            yield item

    # The foreign-patch check would (rightly) refuse the counting patch itself.
    monkeypatch.setattr(base, "check_library_classes", lambda model: None)
    monkeypatch.setattr(nn.Module, "named_modules", counting)
    explainer.attribute(ids, target=3, return_tokens=True)
    monkeypatch.undo()
    assert len(yielded) < 1.5 * count, f"{len(yielded) / count:.1f} walks of the whole model in one explanation"


def test_per_walk_answers_once_per_hold_and_afresh_outside():
    model, other = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    assert module_walk.per_walk(model, "key", compute) == 1         # no hold: computed
    with exclusive(model):
        assert module_walk.per_walk(model, "key", compute) == 2
        assert module_walk.per_walk(model, "key", compute) == 2     # remembered inside the hold
        assert module_walk.per_walk(model, "other key", compute) == 3
        assert module_walk.per_walk(other, "key", compute) == 4     # another model: not its walk
    with exclusive(model):
        assert module_walk.per_walk(model, "key", compute) == 5     # a new hold asks again


def test_blocks_and_configs_follow_a_module_replaced_between_explanations():
    """The answers remembered per hold are not carried over: a model whose attention module is
    swapped between two calls is explained through the new one."""
    from transformers import BertConfig, BertModel

    from captum_transformers.adapters.huggingface.adapter import HuggingFaceAdapter
    from captum_transformers.model_state import patching

    config = dict(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    model, donor = BertModel(BertConfig(**config)), BertModel(BertConfig(**config))
    adapter = HuggingFaceAdapter()
    with exclusive(model):
        before = adapter.blocks(model)
        assert patching.reachable_configs(model) == [model.config]
    model.encoder.layer[0].attention.self = donor.encoder.layer[0].attention.self
    with exclusive(model):
        after = adapter.blocks(model)
        # BERT's attention modules keep their model's config: the swapped-in one brings its own.
        assert {id(c) for c in patching.reachable_configs(model)} == {id(model.config), id(donor.config)}
    assert [b.module for b in after] == [donor.encoder.layer[0].attention.self]
    assert [b.module for b in before] != [b.module for b in after]


def test_configs_are_found_behind_a_wrapper_with_a_config_property():
    from transformers import BertConfig, BertModel

    from captum_transformers.model_state import patching

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = BertModel(BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=16))

        @property
        def config(self):
            return self.inner.config

    wrapper = Wrapper()
    assert patching.reachable_configs(wrapper) == [wrapper.inner.config]


def test_is_leaf_reads_the_children_as_children_does():
    holder = torch.nn.Module()
    holder.register_module("slot", None)  # a declared child that is None: no child
    cases = [torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()), holder, torch.nn.Sequential()]
    for module in cases:
        assert module_walk.is_leaf(module) == (next(module.children(), None) is None), module
    assert module_walk.is_leaf(holder) and not module_walk.is_leaf(cases[1])
