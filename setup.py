"""hpcpax: sparsity-aware hybrid data parallelism (Parallax) for MPI codes."""

from setuptools import find_packages, setup

setup(
    name="hpcpax",
    version="0.1.0",
    description="MPI-native hybrid data parallelism for models with sparse embeddings",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hpcpax", "hpcpax.*"]) + ["hpcpax.kernels", "hpcpax.jobscripts"],
    # The CUDA sources and Slurm templates live in top-level folders (the
    # user asked for that layout) and ship inside the package as data.
    package_dir={"hpcpax.kernels": "kernels", "hpcpax.jobscripts": "jobscripts"},
    package_data={
        "hpcpax.kernels": ["*.cu", "*.cuh"],
        "hpcpax.jobscripts": ["*.sbatch"],
        "hpcpax.plan": ["presets/*.json"],
    },
    install_requires=["numpy>=1.24", "mpi4py>=3.1", "h5py>=3.8", "tqdm>=4.60", "threadpoolctl>=3.1"],
    extras_require={
        "mpich": ["mpi4py>=4.0", "mpich"],
        "gpu": ["cupy-cuda12x"],
        "fast": ["numba>=0.59"],
        "plot": ["matplotlib>=3.5"],
        "torch": ["torch>=2.1"],
        # public models for benchmarks/torch_public_models.py (deepctr-torch imports
        # requests without declaring it)
        "bench": ["torch>=2.1", "deepctr-torch>=0.3", "transformers>=4.40", "requests"],
        "test": [
            "pytest>=7",
            "pytest-mpi>=0.6",
            "pytest-timeout>=2.1",
            "hypothesis>=6",
            "h5py>=3.8",
            "numba>=0.59",
            "matplotlib>=3.5",
        ],
    },
    entry_points={"console_scripts": ["hpcpax-train=hpcpax.train:main"]},
)
