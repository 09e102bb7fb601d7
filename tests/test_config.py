"""The "fssdp" section: typed, named errors before any collective, accepted next to DeepSpeed's keys."""
import json

import pytest
import torch
import torch.distributed

import ds_fssdp
from ds_fssdp import FSSDPConfig, FSSDPConfigError, FSSDPMoE

BAD = [
    ({"materialization_budget": -1}, "fssdp.materialization_budget (-1) must be \"auto\" or an int >= 0"),
    ({"overlap_degree": -2}, "fssdp.overlap_degree (-2) must be \"auto\" or an int >= 0"),
    ({"overlap_degree": "max"}, "fssdp.overlap_degree ('max') must be \"auto\" or an int >= 0"),
    ({"materialization_budget": "auto"}, "fssdp.materialization_budget (\"auto\") needs fssdp.replica_memory_bytes"),
    ({"replica_memory_bytes": -5}, "fssdp.replica_memory_bytes (-5)"),
    ({"smartmoe_interval": 0}, "fssdp.smartmoe_interval (0) must be >= 1"),
    ({"calibration_latency_budget": -1.0}, "fssdp.calibration_latency_budget (-1.0)"),
    ({"hardware": {"flops": 1e12}}, "fssdp.hardware"),
    ({"overlap_degree": 2.5}, "fssdp.overlap_degree (2.5)"),
    ({"policy": "fastest"}, "fssdp.policy ('fastest') must be one of"),
    ({"reshard_interval": -1}, "fssdp.reshard_interval (-1) must be >= 0"),
    ({"load_window": 0}, "fssdp.load_window (0) must be >= 1"),
    ({"enabled": "yes"}, "fssdp.enabled ('yes')"),
    ({"rematerialize": 1}, "fssdp.rematerialize (1)"),
    ({"grads_in_gaps": "yes"}, "fssdp.grads_in_gaps ('yes')"),
    ({"grads_in_gaps": 0}, "fssdp.grads_in_gaps (0)"),
    ({"calibration": "no"}, "fssdp.calibration ('no')"),
    ({"one_copy_per_destination": "yes"}, "fssdp.one_copy_per_destination ('yes')"),
    ({"one_copy_per_destination": 0}, "fssdp.one_copy_per_destination (0)"),
    ({"ranks_per_node": 0}, "fssdp.ranks_per_node (0)"),
    ({"ranks_per_node": "two"}, "fssdp.ranks_per_node ('two') must be \"auto\", null or an int >= 1"),
    ({"materialisation_budget": 2}, "fssdp.materialisation_budget (2) is not a known key"),
    ({"router_bias_update_rate": -0.1}, "fssdp.router_bias_update_rate (-0.1)"),
    ({"pipeline_degree": 0}, "fssdp.pipeline_degree (0) must be \"auto\", an int >= 1 or {\"forward\": n, \"backward\": n}"),
    ({"pipeline_degree": "max"}, "fssdp.pipeline_degree ('max') must be \"auto\", an int >= 1 or {\"forward\": n, \"backward\": n}"),
    ({"pipeline_degree": 2.0}, "fssdp.pipeline_degree (2.0) must be \"auto\", an int >= 1 or {\"forward\": n, \"backward\": n}"),
    ({"pipeline_degree": True}, "fssdp.pipeline_degree (True) must be \"auto\", an int >= 1 or {\"forward\": n, \"backward\": n}"),
    ({"pipeline_degree": {"forward": 0, "backward": 2}}, "fssdp.pipeline_degree ({'forward': 0, 'backward': 2}) must be \"auto\", an int >= 1 or {\"forward\": n, \"backward\": n}"),
    ({"pipeline_degree": {"forward": 2}}, "fssdp.pipeline_degree ({'forward': 2}) must be \"auto\", an int >= 1 or {\"forward\": n, \"backward\": n}"),
    ({"pipeline_degree": {"forward": 2, "backward": 1, "both": 3}}, "fssdp.pipeline_degree ({'forward': 2, 'backward': 1, 'both': 3}) must be \"auto\", an int >= 1 or {\"forward\": n, \"backward\": n}"),
]


@pytest.mark.parametrize("section,message", BAD)
def test_bad_values_name_key_and_value(section, message):
    with pytest.raises(FSSDPConfigError) as err:
        FSSDPConfig.from_ds_config({"fssdp": section})
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)


def test_defaults_and_missing_section():
    cfg = FSSDPConfig.from_ds_config({"fssdp": {}})
    assert cfg.enabled and cfg.policy == "fssdp" and cfg.load_window == 5 and cfg.ranks_per_node == "auto"
    assert cfg.one_copy_per_destination is True
    assert not FSSDPConfig.from_ds_config({"train_batch_size": 8}).enabled
    with pytest.raises(FSSDPConfigError, match="must be an object"):
        FSSDPConfig.from_ds_config({"fssdp": [1, 2]})


def test_pipeline_degree_forms():
    assert FSSDPConfig.from_ds_config({"fssdp": {}}).pipeline_degrees() == "auto"
    assert FSSDPConfig.from_ds_config({"fssdp": {"pipeline_degree": "auto"}}).pipeline_degrees() == "auto"
    assert FSSDPConfig.from_ds_config({"fssdp": {"pipeline_degree": 1}}).pipeline_degrees() == (1, 1)
    assert FSSDPConfig.from_ds_config({"fssdp": {"pipeline_degree": 4}}).pipeline_degrees() == (4, 4)
    cfg = FSSDPConfig.from_ds_config({"fssdp": {"pipeline_degree": {"forward": 3, "backward": 2}}})
    assert cfg.pipeline_degrees() == (3, 2)


def test_ranks_per_node_resolution():
    cfg = FSSDPConfig.from_ds_config({"fssdp": {"ranks_per_node": "auto"}})
    assert cfg.resolve_ranks_per_node(8, env={"LOCAL_SIZE": "4"}) == 4
    assert cfg.resolve_ranks_per_node(8, env={"LOCAL_WORLD_SIZE": "2"}) == 2
    assert cfg.resolve_ranks_per_node(8, env={}) == 8
    cfg = FSSDPConfig.from_ds_config({"fssdp": {"ranks_per_node": None}})
    assert cfg.resolve_ranks_per_node(8, env={"LOCAL_SIZE": "4"}) == 4
    cfg = FSSDPConfig.from_ds_config({"fssdp": {"ranks_per_node": 3}})
    with pytest.raises(FSSDPConfigError, match=r"fssdp.ranks_per_node \(3 -> 3\) must divide the world size \(4\)"):
        cfg.resolve_ranks_per_node(4)


def test_deepspeed_accepts_the_section_from_hjson(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig
    path = tmp_path / "ds.hjson"
    path.write_text("{\n  train_batch_size: 4\n  # FSSDP lives beside DeepSpeed's keys\n"
                    "  fssdp: {\n    policy: ep\n    materialization_budget: 3\n  }\n}\n")
    ds = DeepSpeedConfig(str(path))
    assert ds._param_dict["fssdp"]["policy"] == "ep"
    from ds_fssdp.runtime.engine import _read_config
    cfg = FSSDPConfig.from_ds_config(_read_config(None, str(path), None))
    assert cfg.policy == "ep" and cfg.materialization_budget == 3


def _tiny_model():
    return torch.nn.Sequential(FSSDPMoE(hidden_size=4, ffn_hidden_size=8, num_experts=4))


@pytest.mark.parametrize("config,message", [
    ({"train_batch_size": 2, "fssdp": {"load_window": -3}}, r"fssdp.load_window \(-3\)"),
    # Nothing silently ignored: FSSDPMoE's gate has no router bias for this key to move.
    ({"train_batch_size": 2, "fssdp": {"router_bias_update_rate": 0.01}},
     r"fssdp.router_bias_update_rate \(0.01\) is set, but no MoE layer"),
])
def test_initialize_refuses_before_any_collective(config, message):
    with pytest.raises(FSSDPConfigError, match=message):
        ds_fssdp.initialize(model=_tiny_model(), config=json.loads(json.dumps(config)))
    assert not torch.distributed.is_initialized()


def test_initialize_refuses_model_parallel_and_pipeline():
    with pytest.raises(FSSDPConfigError, match="model/tensor parallelism"):
        ds_fssdp.initialize(model=_tiny_model(), config={"train_batch_size": 2, "fssdp": {}}, mpu=object())
    assert not torch.distributed.is_initialized()


def test_expert_optimizer_follows_the_dense_one_and_refuses_others():
    from ds_fssdp.runtime.expert_optimizer import build_expert_optimizer
    dense = [torch.nn.Parameter(torch.zeros(2))]
    expert = [torch.zeros(3, 4, requires_grad=True)]
    built = build_expert_optimizer(torch.optim.AdamW(dense, lr=0.1, betas=(0.8, 0.9), weight_decay=0.3), expert)
    assert type(built) is torch.optim.AdamW
    assert built.defaults["lr"] == 0.1 and built.defaults["betas"] == (0.8, 0.9)
    assert built.defaults["weight_decay"] == 0.3
    assert type(build_expert_optimizer(torch.optim.SGD(dense, lr=0.1, momentum=0.5), expert)) is torch.optim.SGD
    assert build_expert_optimizer(None, expert) is None
    with pytest.raises(FSSDPConfigError, match="optimizer Adagrad is not supported"):
        build_expert_optimizer(torch.optim.Adagrad(dense, lr=0.1), expert)
