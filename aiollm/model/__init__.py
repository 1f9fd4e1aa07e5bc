"""The model layer: load a Llama-family model (GGUF or HF directory) and run its forward split into
S-part operations and R-part attention; a colocated `generate` runs them together.

    model = aiollm.model.load("smollm2")              # or load("x.gguf"), load("hf_dir/"), dtype="bf16"
    h = model.embed(ids); q, k, v = model.pre_attention(layer, h, positions); ...
"""

from aiollm.model.config import ModelConfig, RopeScaling
from aiollm.model.llama import LlamaModel
from aiollm.model.loader import load
from aiollm.model.tokenizer import Tokenizer

__all__ = ["LlamaModel", "ModelConfig", "RopeScaling", "Tokenizer", "load"]
