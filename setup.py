from setuptools import find_packages, setup

setup(
    name="lins_ds",
    version="0.1.0",
    description="Lins: independent parameter / gradient / optimizer-state sharding for DeepSpeed",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["lins_ds", "lins_ds.*"]),
    python_requires=">=3.9",
    # The planner (lins_ds.plan, `lins-ds plan`) is pure Python; the engine needs torch and deepspeed.
    install_requires=["deepspeed>=0.19.6,<0.20", "torch>=2.4"],
    extras_require={
        "test": ["pytest", "transformers", "accelerate", "safetensors", "matplotlib"],
        "bench": ["matplotlib", "tqdm"],
    },
    entry_points={"console_scripts": ["lins-ds=lins_ds.cli:main"]},
)
