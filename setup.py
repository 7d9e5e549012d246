"""Package discovery that pyproject.toml cannot express alone.

The library's packages are found under ``lightning_accel/``; the Hydra config tree
``conf/`` and the recipes ``recipes/`` sit at the top of the repository and are mapped
into the wheel as ``lightning_accel.conf`` and ``lightning_accel.recipes`` (see
``[tool.setuptools.package-dir]``), so installed and source checkouts read the same files.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["lightning_accel", "lightning_accel.*"]) + ["lightning_accel.conf", "lightning_accel.recipes"])
