"""Packaging that pyproject.toml cannot express: the top-level ``configs/`` folder ships as ``poros_lightning/configs``.

So a wheel carries every shipped config, and ``poros-lightning fit --config qwen2.5-7b`` or ``poros-lightning demo``
find them from any folder after a plain ``pip install .`` (see ``poros_lightning/assets/configs.py``). The package
data globs are in pyproject.toml; everything else is too.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["poros_lightning*"]), "poros_lightning.configs"],
    package_dir={"poros_lightning.configs": "configs"},
)
