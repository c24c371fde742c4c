"""The hybrid-attention MoE model (KDA + MLA, or Qwen3-Next's GDN + gated attention; dense/MoE
FFN) and its mixing contexts."""

from harts.exec.model.context import MixingContext, PackedContext
from harts.exec.model.model import Block, HybridModel, ModelOutput, build_model
from harts.exec.model.weights import WeightLoadError, load_state_dict_file, save_state_dict_file

__all__ = [
    "Block",
    "HybridModel",
    "MixingContext",
    "ModelOutput",
    "PackedContext",
    "WeightLoadError",
    "build_model",
    "load_state_dict_file",
    "save_state_dict_file",
]
