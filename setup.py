import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "lins_ds_autoload.pth"  # run by the interpreter at start-up from site-packages: imports lins_ds_autoload


class BuildPyWithPth(build_py):
    """Ships ``lins_ds_autoload.pth`` at the root of site-packages, for wheels and editable installs alike (an
    editable wheel takes what lands in the install directory; a regular one takes build_lib)."""

    def run(self):
        super().run()
        target = self.get_finalized_command("install").install_lib if getattr(self, "editable_mode", False) else self.build_lib
        os.makedirs(target, exist_ok=True)
        self.copy_file(PTH, os.path.join(target, PTH), preserve_mode=False)


setup(
    name="lins_ds",
    version="0.1.0",
    description="Lins: independent parameter / gradient / optimizer-state sharding for DeepSpeed",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["lins_ds", "lins_ds.*"]),
    py_modules=["lins_ds_autoload"],
    cmdclass={"build_py": BuildPyWithPth},
    python_requires=">=3.9",
    # The planner (lins_ds.plan, `lins-ds plan`) is pure Python; the engine needs torch and deepspeed.
    install_requires=["deepspeed>=0.19.6,<0.20", "torch>=2.4"],
    extras_require={
        "test": ["pytest", "transformers", "accelerate", "safetensors", "matplotlib", "peft", "trl"],
        "bench": ["matplotlib", "tqdm"],
    },
    entry_points={"console_scripts": ["lins-ds=lins_ds.cli:main"]},
)
