"""Lists the packages under their installed names: setuptools' `find` cannot prefix them with `jetroll.`."""

from setuptools import find_packages, setup

FOLDERS = ("shared", "services", "functions", "bench")

setup(packages=[f"jetroll.{name}" for name in find_packages(include=[f"{folder}*" for folder in FOLDERS])])
