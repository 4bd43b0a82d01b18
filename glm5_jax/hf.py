"""Load and save Hugging Face GLM-5 (`glm_moe_dsa`) checkpoints, whole or sharded on a mesh.

Checkpoint layout (docs/design.md §1): torch Linear weights are [out, in]; routed experts
are stored per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`); the MTP
layer is `model.layers.{num_hidden_layers}.*` with `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` next to a full decoder layer. transformers' in-memory fused
expert layout (`mlp.experts.gate_up_proj [E, 2I, d]`, `mlp.experts.down_proj
[E, d, I]`) is accepted on load too.

    cfg, params = load_pretrained("path/to/dir")                   # one host-side tree
    cfg, params = load_pretrained("path/to/dir", mesh=mesh)        # global arrays, sharded
    save_pretrained(cfg, params, "out_dir")      # transformers loads it
    save_pretrained(cfg, quant.quantize_tree(params, scheme), "int4_dir")   # INT4 (hf_int4.py)
    cfg, qparams = load_pretrained("int4_dir", quantized=True)     # QArray leaves, packed

The layout table is hf_layout.py (every parameter leaf as views of HF tensors), reading
hf_load.py, writing hf_save.py, the INT4 stored tensors hf_int4.py.
"""

from glm5_jax.hf_load import load_pretrained
from glm5_jax.hf_load import quantization
from glm5_jax.hf_load import read_config
from glm5_jax.hf_save import save_pretrained

__all__ = ["load_pretrained", "quantization", "read_config", "save_pretrained"]
