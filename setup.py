"""glm5-jax: the GLM-5 model and training recipe in JAX / Flax."""

from setuptools import find_packages, setup

setup(
    name="glm5-jax",
    version="0.1.0",
    description="GLM-5 (MLA + DSA + MoE + shared MTP) in JAX/Flax, with Pallas DSA kernels",
    python_requires=">=3.10",
    packages=find_packages(include=["glm5_jax", "glm5_jax.*", "pallas_kernels",
                                    "pallas_kernels.*"]),
    # glm5_jax/stream_matmul.cc: compiled on first use (the system's C++ compiler, g++).
    package_data={"glm5_jax": ["*.cc"]},
    install_requires=[
        "jax>=0.10.2,<0.11",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8",
        "chex>=0.1.92",
        "ml_collections>=1.1.0",
        "absl-py",
        "orbax-checkpoint>=0.12.8",
        "grain>=0.2.18",
        "safetensors>=0.6",
        "ml_dtypes",
        "numpy",
        "tensorboardX",
        "matplotlib",
    ],
    extras_require={
        # nbclient, nbformat, ipykernel: tests/test_notebook.py runs notebooks/quickstart.ipynb;
        # pytest-xdist: the default run (launch/local.sh test) spreads test files over processes.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "nbclient>=0.10", "nbformat>=5.9",
                 "ipykernel>=6.29"],
        # Reference implementation for parity tests and the converter's checks.
        "hf": ["torch==2.13.0", "transformers>=5.24,<6"],
        # Deviceless compiles of the kernels (experiments/aot_*_kernels.py): libtpu
        # matching this jax, for TPU topologies described on a CPU host; Triton and its
        # ptxas, for the GPU kernels at sm_90.
        "aot": ["jax[tpu]>=0.10.2,<0.11", "triton>=3.9"],
        # backend="ray" of the async RL loop (glm5_jax/rl/orchestration/ray_backend.py): plain `ray`
        # starts a local cluster and runtime_env env_vars; `ray[default]` (dashboard) is not needed.
        "ray": ["ray>=2.40"],
    },
)
