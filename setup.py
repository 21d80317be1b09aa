"""The sixfold distribution's packages: one import name, ``sixfold``, over the repository's root folders.

The project's metadata lives in pyproject.toml; this file only maps the folders the design asks
for at the root (server/, partitioner/, ...) to ``sixfold.server``, ``sixfold.partitioner``, ...
so that a wheel installs ``sixfold/`` alone and an editable install imports the same names.
"""

from setuptools import find_packages, setup

SUBPACKAGES = ("models", "backends", "partitioner", "server", "loadgen", "simulate")

packages = ["sixfold"]
package_dir = {"sixfold": "sixfold"}
for folder in SUBPACKAGES:
    package_dir[f"sixfold.{folder}"] = folder
    packages += [f"sixfold.{folder}"] + [f"sixfold.{folder}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
