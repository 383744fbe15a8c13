"""``moe_cte`` with AWS NKI-lib's signature (``nkilib.core.moe.moe_cte.moe_cte``).

Blockwise MoE for context encoding: for each block b with e = block_to_expert[b] and ids its
block_size slots, ``out[ids] += aff[ids, e] * ((silu(x Wg[e]) * (x Wu[e])) Wd[e])``; output
(T+1, H). Implemented: ``MoECTEImplementation.shard_on_i`` (the intermediate dimension split
across the LNC's cores, :func:`torchneuron.nkilib.moe.moe_cte_shard_on_i`; LNC=1 too).
Not implemented (NotImplementedError): the other implementations (torchneuron's
shard-on-block variant is :func:`torchneuron.nkilib.moe_cte`), biases, quantisation,
activation checkpointing, activations other than SiLU, scaling modes other than POST_SCALE,
clamps, ``conditions`` (hybrid / dropping), ``skip_dma``.
"""

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

import nki
import nki.language as nl
from ...._support import unsupported
from ...utils.common_types import ActFnType, ExpertAffinityScaleMode
from torchneuron.nkilib.moe import moe_cte_shard_on_i

__all__ = ["moe_cte", "MoECTESpec", "MoECTEImplementation", "ShardOnIConfig",
           "ShardOnBlockConfig", "QuantizationConfig", "SkipMode"]


class MoECTEImplementation(Enum):
    shard_on_block = 0
    shard_on_i = 1
    shard_on_i_hybrid = 2
    shard_on_i_dropping = 3
    shard_on_block_mx = 4
    shard_on_i_mx = 5
    shard_on_i_mx_hybrid = 6


@dataclass
class QuantizationConfig(nl.NKIObject):
    gate_up_proj_scale: Optional[Any] = None
    down_proj_scale: Optional[Any] = None


class BlockShardStrategy(Enum):
    PING_PONG = 1
    HI_LO = 2


@dataclass
class ShardOnBlockConfig(nl.NKIObject):
    n_block_per_iter: int = 1
    block_sharding_strategy: BlockShardStrategy = BlockShardStrategy.PING_PONG
    n_static_blocks: int = -1
    n_dynamic_blocks: int = 55


@dataclass
class ShardOnIConfig(nl.NKIObject):
    checkpoint_activation: bool = False
    expert_affinity_multiply_on_I: bool = False
    num_static_block: Optional[int] = None


@dataclass
class MoECTESpec(nl.NKIObject):
    implementation: MoECTEImplementation
    shard_on_block: Optional[ShardOnBlockConfig] = None
    shard_on_I: Optional[ShardOnIConfig] = None

    def __post_init__(self):
        if self.implementation in (MoECTEImplementation.shard_on_block,
                                   MoECTEImplementation.shard_on_block_mx):
            if self.shard_on_block is None:
                self.shard_on_block = ShardOnBlockConfig()
        elif self.shard_on_I is None:
            self.shard_on_I = ShardOnIConfig()


class SkipMode(nl.NKIObject):
    skip_token: bool = False
    skip_weight: bool = False

    def __init__(self, skip_token: bool = False, skip_weight: bool = False):
        self.skip_token = skip_token
        self.skip_weight = skip_weight


@nki.jit
def moe_cte(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
            token_position_to_id, block_to_expert, block_size, spec, conditions=None,
            gate_and_up_proj_bias=None, down_proj_bias=None, quantization_config=None,
            gate_up_activations_T=None, down_activations=None,
            activation_function=ActFnType.SiLU, skip_dma=SkipMode(False, False),
            compute_dtype=nl.bfloat16, is_tensor_update_accumulating=True,
            expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
            gate_clamp_upper_limit=None, gate_clamp_lower_limit=None, up_clamp_upper_limit=None,
            up_clamp_lower_limit=None):
    """Blockwise MoE expert computation; returns (T+1, H)."""
    name = "moe_cte"
    if spec.implementation != MoECTEImplementation.shard_on_i:
        unsupported(name, f"implementation={spec.implementation.name}",
                    "use MoECTEImplementation.shard_on_i, or torchneuron.nkilib.moe_cte "
                    "(shard on block)")
    cfg = spec.shard_on_I
    if cfg is not None and (cfg.checkpoint_activation or cfg.expert_affinity_multiply_on_I):
        unsupported(name, "checkpoint_activation / expert_affinity_multiply_on_I",
                    "leave ShardOnIConfig at its defaults")
    for arg, val in (("conditions", conditions), ("gate_and_up_proj_bias", gate_and_up_proj_bias),
                     ("down_proj_bias", down_proj_bias),
                     ("quantization_config", quantization_config),
                     ("gate_up_activations_T", gate_up_activations_T),
                     ("down_activations", down_activations),
                     ("gate_clamp_upper_limit", gate_clamp_upper_limit),
                     ("gate_clamp_lower_limit", gate_clamp_lower_limit),
                     ("up_clamp_upper_limit", up_clamp_upper_limit),
                     ("up_clamp_lower_limit", up_clamp_lower_limit)):
        if val is not None:
            unsupported(name, arg, f"omit {arg}")
    if activation_function != ActFnType.SiLU:
        unsupported(name, f"activation_function={activation_function.name}", "use SiLU")
    if expert_affinities_scaling_mode != ExpertAffinityScaleMode.POST_SCALE:
        unsupported(name, f"expert_affinities_scaling_mode={expert_affinities_scaling_mode.name}",
                    "use POST_SCALE")
    if skip_dma.skip_token or skip_dma.skip_weight:
        unsupported(name, "skip_dma", "omit skip_dma")
    return moe_cte_shard_on_i(hidden_states, expert_affinities_masked, gate_up_proj_weight,
                              down_proj_weight, token_position_to_id, block_to_expert,
                              block_size)
