from setuptools import setup, find_packages

setup(
    name="pyfused",
    version="0.1.0",
    packages=find_packages(include=["pyfused", "pyfused.*"]) + ["pyfused.kernels", "pyfused.benchmarks"],
    package_dir={"pyfused.kernels": "kernels", "pyfused.benchmarks": "benchmarks"},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "packaging"],
)
