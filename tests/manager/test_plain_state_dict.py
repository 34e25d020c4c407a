"""The plain models' state dicts (manager/plain_state_dict.py) are DCP's: same keys in
the same order, the same values, the same tensors (storage); anything the shortcut does
not cover, or a structure that changed between calls, takes or matches DCP's path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from quicksave.manager.plain_state_dict import (
    FLAT,
    model_state_dict,
    optimizer_state_dict,
    plain_model_state_dict,
    plain_optimizer_state_dict,
)
from quicksave.manager.states import ModelState, OptimizerState


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.register_buffer("scale", torch.ones(d))
        self.register_buffer("cache", torch.zeros(d), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x)))) * self.scale


class Counter(nn.Module):
    """A module with extra state (saved under ``_extra_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 3

    def get_extra_state(self) -> Any:
        return {"seen": self.seen}

    def set_extra_state(self, state: Any) -> None:
        self.seen = state["seen"]


class TinyLM(nn.Module):
    """Embedding tied to the output head, a stack of blocks, buffers, extra state, a
    frozen parameter and a block shared twice in the stack."""

    def __init__(self, vocab: int = 50, d: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        shared = Block(d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)] + [shared, shared])
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.counter = Counter()
        self.frozen = nn.Parameter(torch.randn(d), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.frozen
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        optim.zero_grad()
        if isinstance(model, TinyLM):
            out = model(torch.randint(0, 50, (2, 5)))
        else:
            out = model(torch.randn(3, model[0].in_features))
        out.square().mean().backward()
        optim.step()


def groups(model: nn.Module, lr: float = 0.01) -> list[dict[str, Any]]:
    """Decay and no-decay groups (several param groups, different settings)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in params if p.dim() >= 2]
    vectors = [p for p in params if p.dim() < 2]
    return [
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "weight_decay": 0.0, "lr": lr / 2},
    ]


def same(ours: dict[str, Any], dcp: dict[str, Any], *, identical: bool) -> None:
    """Same keys in the same order; tensors share storage, offset, shape, strides and
    bytes (``identical``: the very objects, as the optimizer's values are)."""
    assert list(ours) == list(dcp)
    for key, value in dcp.items():
        mine = ours[key]
        assert type(mine) is type(value), key
        if identical:
            assert mine is value, key
        if isinstance(value, torch.Tensor):
            assert mine.untyped_storage().data_ptr() == value.untyped_storage().data_ptr(), key
            assert mine.storage_offset() == value.storage_offset(), key
            assert (mine.shape, mine.stride(), mine.dtype) == (
                value.shape,
                value.stride(),
                value.dtype,
            )
            assert mine.requires_grad == value.requires_grad, key
            assert torch.equal(mine, value), key
        else:
            assert mine == value, key


def check_model(model: nn.Module) -> None:
    ours = plain_model_state_dict(model)
    assert ours is not None, "the plain path was not taken"
    same(ours, get_model_state_dict(model), identical=False)


def check_optimizer(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    ours = plain_optimizer_state_dict(model, optim)
    assert ours is not None, "the plain path was not taken"
    same(ours, get_optimizer_state_dict(model, optim, options=FLAT), identical=True)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
}


@pytest.mark.parametrize("build", [mlp, TinyLM], ids=["mlp", "tiny_lm"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("grouped", [False, True], ids=["one_group", "two_groups"])
def test_matches_dcp(build: Any, kind: str, grouped: bool) -> None:
    model = build()
    params = groups(model) if grouped else [p for p in model.parameters() if p.requires_grad]
    optim = OPTIMIZERS[kind](params)
    train(model, optim)
    check_model(model)
    check_optimizer(model, optim)
    optim.param_groups[0]["lr"] = 0.5  # a scheduler's change is read live
    check_optimizer(model, optim)
    first = next(n for n, p in model.named_parameters() if p is optim.param_groups[0]["params"][0])
    assert optimizer_state_dict(model, optim)[f"param_groups.{first}.lr"] == 0.5


def test_tied_weight_and_buffers_are_dcp_s() -> None:
    model = TinyLM()
    sd = plain_model_state_dict(model)
    assert sd is not None
    assert "head.weight" in sd and "tok.weight" in sd  # tied: both names, one storage
    assert sd["head.weight"].data_ptr() == model.tok.weight.data_ptr()
    assert "blocks.0.scale" in sd and "blocks.0.cache" not in sd
    assert sd["counter._extra_state"] == {"seen": 3}
    assert "blocks.4.fc1.weight" in sd  # the shared block under both of its names


def test_load_state_dict_replaced_the_state_tensors() -> None:
    model = TinyLM()
    optim = torch.optim.AdamW(groups(model), lr=0.01)
    train(model, optim)
    before = plain_optimizer_state_dict(model, optim)
    other = TinyLM()
    other_optim = torch.optim.AdamW(groups(other), lr=0.01)
    train(other, other_optim, steps=3)
    optim.load_state_dict(other_optim.state_dict())  # new state tensors (copies)
    check_optimizer(model, optim)
    after = plain_optimizer_state_dict(model, optim)
    first = next(k for k in after if k.endswith("exp_avg"))
    assert after[first] is not before[first]
    assert after[first] is optim.state[model.tok.weight]["exp_avg"]


def test_param_group_added_later_is_seen() -> None:
    model = TinyLM()
    late = model.blocks[0].fc2
    optim = torch.optim.AdamW(
        [p for n, p in model.named_parameters() if p.requires_grad and "blocks.0.fc2" not in n]
    )
    train(model, optim)
    check_optimizer(model, optim)
    assert not any("blocks.0.fc2" in k for k in optimizer_state_dict(model, optim))
    optim.add_param_group({"params": list(late.parameters()), "lr": 0.3})
    check_optimizer(model, optim)  # settings of the new group, before it has state
    train(model, optim)
    check_optimizer(model, optim)
    sd = optimizer_state_dict(model, optim)
    assert sd["param_groups.blocks.0.fc2.weight.lr"] == 0.3
    assert "state.blocks.0.fc2.weight.exp_avg" in sd


def test_state_created_later_is_seen() -> None:
    model = mlp()
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    assert plain_optimizer_state_dict(model, optim) is None  # no state yet: DCP's path
    model[0].weight.requires_grad_(False)  # no gradient: no state for it yet
    train(model, optim, steps=1)
    check_optimizer(model, optim)
    assert "state.0.weight.momentum_buffer" not in optimizer_state_dict(model, optim)
    model[0].weight.requires_grad_(True)
    train(model, optim, steps=1)
    check_optimizer(model, optim)
    assert "state.0.weight.momentum_buffer" in optimizer_state_dict(model, optim)


def test_replaced_parameter_is_seen() -> None:
    model = mlp()
    optim = torch.optim.AdamW(model.parameters())
    train(model, optim)
    model[2].bias = nn.Parameter(torch.zeros(4))
    check_model(model)
    assert model_state_dict(model)["2.bias"].data_ptr() == model[2].bias.data_ptr()
    # the optimizer still holds the old parameter, which the model no longer has: DCP
    # fails, and so does the shortcut (it hands over to DCP)
    assert plain_optimizer_state_dict(model, optim) is None
    with pytest.raises(KeyError):
        optimizer_state_dict(model, optim)
    # the optimizer told of the new parameter: its state is saved under its name
    old = optim.param_groups[0]["params"][3]
    optim.param_groups[0]["params"][3] = model[2].bias
    optim.state[model[2].bias] = optim.state.pop(old)
    check_optimizer(model, optim)


def test_module_added_later_is_seen() -> None:
    model = mlp()
    check_model(model)
    model.append(nn.Linear(4, 2))
    check_model(model)
    assert "3.weight" in model_state_dict(model)


class Nested(torch.optim.Optimizer):
    """An optimizer whose state nests dicts (keys of any type), as Shampoo's does."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                state["blocks"] = {0: torch.zeros(2), "b": {"c": torch.ones(1), "n": 2.5}}


def test_nested_state_flattens_as_dcp() -> None:
    model = mlp()
    optim = Nested(model.parameters())
    optim.step()
    check_optimizer(model, optim)
    assert "state.0.weight.blocks.0" in optimizer_state_dict(model, optim)
    assert "state.0.weight.blocks.b.c" in optimizer_state_dict(model, optim)


def test_unsupported_state_value_fails_as_dcp() -> None:
    model = mlp()
    optim = Nested(model.parameters())
    optim.step()
    optim.state[model[0].weight]["odd"] = None
    assert plain_optimizer_state_dict(model, optim) is None
    with pytest.raises(NotImplementedError):
        optimizer_state_dict(model, optim)


def _fqn_modifiers(model: nn.Module) -> None:
    model[0]._fqn_modifiers = lambda: {}


def _hook(model: nn.Module) -> None:
    model[2].register_state_dict_post_hook(lambda *args: None)


def _own_state_dict(model: nn.Module) -> None:
    model.state_dict = lambda *a, **k: nn.Module.state_dict(model, *a, **k)


def _optimizer_hook(optim: torch.optim.Optimizer) -> None:
    optim.register_state_dict_post_hook(lambda optim, sd: sd)


@pytest.mark.parametrize("change", [_fqn_modifiers, _hook, _own_state_dict])
def test_not_plain_takes_dcp_path(change: Any) -> None:
    model = mlp()
    optim = torch.optim.AdamW(model.parameters())
    train(model, optim)
    change(model)
    assert plain_model_state_dict(model) is None
    assert plain_optimizer_state_dict(model, optim) is None
    same(model_state_dict(model), get_model_state_dict(model), identical=False)


def test_optimizer_with_hook_takes_dcp_path() -> None:
    model = mlp()
    optim = torch.optim.AdamW(model.parameters())
    train(model, optim)
    _optimizer_hook(optim)
    assert plain_optimizer_state_dict(model, optim) is None
    same(
        optimizer_state_dict(model, optim),
        get_optimizer_state_dict(model, optim, options=FLAT),
        identical=True,
    )


def test_states_use_it() -> None:
    first, second = mlp(), nn.Sequential(nn.Linear(4, 4))
    second[0].weight.data.fill_(1.0)
    opts = [torch.optim.AdamW(m.parameters()) for m in (first, second)]
    train(first, opts[0])
    opts[1].zero_grad()
    second(torch.randn(2, 4)).sum().backward()
    opts[1].step()
    second_named = nn.ModuleDict({"tail": second})
    model_sd = ModelState([first, second_named]).state_dict()
    assert model_sd["tail.0.weight"].data_ptr() == second[0].weight.data_ptr()
    optim_sd = OptimizerState([first, second_named], opts).state_dict()
    expected = {
        **get_optimizer_state_dict(first, opts[0], options=FLAT),
        **get_optimizer_state_dict(second_named, opts[1], options=FLAT),
    }
    same(optim_sd, expected, identical=True)
