"""ds-fssdp: Fully Sharded Sparse Data Parallelism for Mixture-of-Experts training, as a DeepSpeed
engine extension. The top-level folder ``ops/`` installs as ``ds_fssdp.ops``."""
from setuptools import Extension, find_packages, setup

packages = find_packages(include=["ds_fssdp", "ds_fssdp.*"])
ops_packages = ["ds_fssdp.ops"] + ["ds_fssdp.ops." + p for p in find_packages(where="ops")]

setup(
    name="ds-fssdp",
    version="0.1.0",
    description="Fully Sharded Sparse Data Parallelism (FSSDP) for MoE training on DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages + ops_packages,
    package_dir={"ds_fssdp.ops": "ops"},
    # The planner's, the router's and the lower bound's hot paths (Python references beside them).
    ext_modules=[Extension("ds_fssdp.planner._fastplan", ["ds_fssdp/planner/_fastplan.c"],
                           # no fused multiply-add: the C placements match their Python references float for float
                           extra_compile_args=["-O3", "-ffp-contract=off"]),
                 Extension("ds_fssdp.moe._fastroute", ["ds_fssdp/moe/_fastroute.c"], extra_compile_args=["-O3"]),
                 # the simulators' lower bound: its chain float for float with its numpy path (no FMA either)
                 Extension("ds_fssdp.sim._fastbound", ["ds_fssdp/sim/_fastbound.c"],
                           extra_compile_args=["-O3", "-ffp-contract=off"])],
    install_requires=[
        # torch is required but not pinned: a GPU user keeps their CUDA build; CPU machines pass
        # constraints/cpu.txt (see README) so pip takes the CPU wheel.
        "torch>=2.4",
        # The FSSDP engine hooks DeepSpeed's optimizer wrappers (global norm): tested on 0.19.x.
        "deepspeed>=0.19.8,<0.20",
        "hjson",
        "numpy",
        "packaging",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "triton": ["triton>=3.0"],
        # peft: the LoRA-on-experts factor layout (ParamWrapper) is read as of 0.21; trl: SFTTrainer tests.
        "test": ["pytest>=8", "pytest-timeout", "scipy", "triton>=3.0", "peft>=0.21.2,<0.22", "trl>=1.16,<2",
                 "datasets", "tokenizers"],
        "hf": ["transformers>=5.20,<6", "accelerate>=1.10"],
    },
)
