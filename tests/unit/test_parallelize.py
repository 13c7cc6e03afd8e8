"""The `training` section: config round trip, mixed-precision policies, which layers are
checkpointed, and that activation checkpointing keeps names and gradients (one process)."""

import pytest
import torch

from trainer.config import ConfigError, TrainConfig, build_config
from trainer.parallelize import (
    apply_activation_checkpointing,
    checkpointed_layers,
    compute_dtype,
    mixed_precision_policies,
)

pytestmark = pytest.mark.timeout(120)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_defaults_leave_cpu_training_as_it_was():
    training = build_config("tiny-cpu").training
    # auto: decided before the ranks start, none on CPU (trainer.launch.resolve_auto_settings)
    assert training.mixed_precision == "auto" and training.activation_checkpointing == "auto"
    assert not training.compile
    assert compute_dtype(training, CPU) == torch.float32
    assert compute_dtype(training, CUDA) == torch.bfloat16


def test_overrides_set_the_training_section_and_it_round_trips():
    config = build_config(
        "tiny-cpu",
        [
            "training.mixed_precision=bf16",
            "training.activation_checkpointing=every_n",
            "training.activation_checkpointing_every=3",
            "training.compile=true",
        ],
    )
    assert compute_dtype(config.training, CPU) == torch.bfloat16
    again = TrainConfig.from_json(config.to_json())
    assert again == config and again.training.compile is True
    # A config written before the section existed still reads (defaults).
    old = config.to_dict()
    del old["training"]
    assert TrainConfig.from_dict(old).training == build_config("tiny-cpu").training


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.mixed_precision=fp16", "training.mixed_precision 'fp16' is not one of auto, bf16, fp32"),
        ("training.activation_checkpointing=some", "is not one of auto, none, full, every_n"),
        ("training.activation_checkpointing_every=0", "at least 1"),
    ],
)
def test_bad_training_values_name_the_choices(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config("tiny-cpu", [override])


def test_bf16_policy_computes_in_bf16_and_reduces_in_fp32():
    block, root = mixed_precision_policies(torch.bfloat16)
    assert block.param_dtype == root.param_dtype == torch.bfloat16
    assert block.reduce_dtype == root.reduce_dtype == torch.float32
    # No output cast: the root returns the loss, already fp32 (tests/unit/test_chunked_loss.py);
    # a cast of logits would upcast the whole batch's at once.
    assert root.output_dtype is None and block.output_dtype is None


def test_fp32_policy_is_fsdps_default():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert mixed_precision_policies(torch.float32) == (MixedPrecisionPolicy(), MixedPrecisionPolicy())


@pytest.mark.parametrize(
    ("mode", "every", "expected"),
    [("none", 2, []), ("full", 2, [0, 1, 2, 3, 4]), ("every_n", 2, [0, 2, 4]), ("every_n", 3, [0, 3])],
)
def test_checkpointed_layers(mode, every, expected):
    training = build_config(
        "tiny-cpu",
        [f"training.activation_checkpointing={mode}", f"training.activation_checkpointing_every={every}"],
    ).training
    assert checkpointed_layers(5, training) == expected


def test_activation_checkpointing_keeps_names_and_gradients():
    from trainer.models.byte_lm import ByteLM, next_token_loss

    config = build_config("tiny-cpu").model
    torch.manual_seed(0)
    plain = ByteLM(config)
    checkpointed = ByteLM(config)
    checkpointed.load_state_dict(plain.state_dict())
    for block in checkpointed.blocks:
        apply_activation_checkpointing(block)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    calls = {"plain": 0, "checkpointed": 0}
    plain.blocks[0].mlp_in.register_forward_hook(lambda *_: calls.__setitem__("plain", calls["plain"] + 1))
    checkpointed.blocks[0].mlp_in.register_forward_hook(
        lambda *_: calls.__setitem__("checkpointed", calls["checkpointed"] + 1)
    )
    batch = torch.randint(0, 256, (2, config.seq_len + 1))
    next_token_loss(plain, batch).backward()
    next_token_loss(checkpointed, batch).backward()
    assert calls == {"plain": 1, "checkpointed": 2}  # recomputed in the backward pass
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_compile_captures_the_layer_and_checkpointing_composes_with_it(monkeypatch):
    """Dynamo captures the layer and AOT autograd traces its backward through the
    checkpointed forward. The backend is aot_eager: inductor's C++ code generation on CPU
    took 18 of this test's 20 s, and no test runs inductor now (docs/performance.md)."""
    import functools

    from torch._dynamo.utils import counters

    from trainer.models.byte_lm import Block
    from trainer.parallelize import apply_compile

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    config = build_config("tiny-cpu").model
    torch.manual_seed(0)
    plain, compiled = Block(config), Block(config)
    compiled.load_state_dict(plain.state_dict())
    apply_compile(compiled)
    apply_activation_checkpointing(compiled)
    counters.clear()
    x = torch.randn(2, config.seq_len, config.d_model)
    plain(x).square().mean().backward()
    compiled(x).square().mean().backward()
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really compiled the forward
    assert list(compiled.state_dict()) == list(plain.state_dict())
    for (name, p), q in zip(plain.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_mesh_is_fsdp_on_one_node_and_hsdp_across_nodes_when_a_nodes_share_fits():
    from trainer.config import ParallelismConfig
    from trainer.parallelize import mesh_shape

    auto = ParallelismConfig()
    gib = 2**30
    assert mesh_shape(auto, 8, 8, 8_000_000_000, 80 * gib) == (1, 8)  # one node: FSDP
    # 8B on 2 nodes of 8 H100s: 16 GB a GPU within a node, so shard in the node.
    assert mesh_shape(auto, 16, 8, 8_000_000_000, 80 * gib) == (2, 8)
    # 70B: 140 GB a GPU within a node would not fit; shard over all 16.
    assert mesh_shape(auto, 16, 8, 70_000_000_000, 80 * gib) == (1, 16)
    assert mesh_shape(auto, 4, 2, 1000, None) == (2, 2)  # CPU: no device memory to fit
    assert mesh_shape(ParallelismConfig(dp_replicate=2), 4, 4, 1000, None) == (2, 2)
    assert mesh_shape(ParallelismConfig(dp_shard=2), 8, 8, 1000, None) == (4, 2)
    assert mesh_shape(ParallelismConfig(dp_replicate=1), 16, 8, 1000, None) == (1, 16)


@pytest.mark.parametrize(
    "replicate, shard",
    [(3, 0), (0, 3), (2, 3), (5, 1)],
)
def test_degrees_that_do_not_make_the_world_say_so_in_one_line(replicate, shard):
    from trainer.config import ParallelismConfig
    from trainer.parallelize import mesh_shape

    with pytest.raises(ConfigError) as error:
        mesh_shape(ParallelismConfig(dp_replicate=replicate, dp_shard=shard), 4, 4, 1000, None)
    message = str(error.value)
    assert "must multiply to the world size, 4" in message and "\n" not in message


def test_negative_degrees_are_refused_when_the_config_is_read():
    with pytest.raises(ConfigError, match=r"parallelism\.dp_replicate and dp_shard must be 0"):
        build_config("tiny-cpu", ["parallelism.dp_replicate=-1"])
