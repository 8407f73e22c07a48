"""cula: CuTe DSL linear-attention kernels for NVIDIA Hopper, drop-in compatible with FLA 0.6.0.

Variants live in submodules, imported on first use so that ``import cula`` stays cheap::

    from cula.kda import chunk_kda
    from cula.lightning import lightning_attn_fwd
"""

__version__ = "0.1.0"
