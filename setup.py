from setuptools import find_packages, setup

setup(
    name="moe-pretrain",
    version="0.1.0",
    description="Distributed Mixture-of-Experts pretraining with DeepSpeed expert parallelism "
    "and an Arrow streaming data pipeline",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(
        include=["moe", "moe.*", "data_pipeline", "data_pipeline.*", "launch", "launch.*"]
    ),
    # The downstream tasks the project ships: YAML files and their JSONL data.
    package_data={"moe": ["tasks/*.yaml", "tasks/*.jsonl"]},
    install_requires=[
        "torch",
        "deepspeed",
        "mpi4py",
        "mpich",
        "pyarrow",
        "sentencepiece",
        "tensorboard",
        "numpy",
        "pyyaml",
        "tqdm",
        "zstandard",
        "safetensors",
        "matplotlib",
        # tokenizer.json data and Hugging Face export of the tokenizer
        "tokenizers",
        # the launcher's and the trainer's process and memory watch
        "psutil",
    ],
    extras_require={
        "hf": ["transformers"],
        "qlora": ["torchao"],
        # moe-scaling fit / predict (curve fitting, root finding, regression;
        # threadpoolctl keeps BLAS on one thread for L-BFGS-B's tiny systems)
        "scaling": ["scipy", "threadpoolctl"],
        # model.cross_entropy: liger (Triton kernels; CUDA machines only)
        "liger": ["liger-kernel"],
        # moe-eval --tasks and eval.downstream: lm-evaluation-harness
        "eval": ["lm-eval"],
        "test": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",
            "transformers",
            "peft",
            "moto[server]",
            "boto3",
            "torchao",
            "pillow",
            "packaging",
            "scipy",
            "threadpoolctl",
            "lm-eval",
        ],
    },
    entry_points={
        "console_scripts": [
            "moe-prepare=launch.prepare:main",
            "moe-launch=launch.launch:main",
            "moe-train=launch.train:main",
            "moe-eval=launch.evaluate:main",
            "moe-plan=launch.plan:main",
            "moe-export=launch.export:main",
            "moe-scaling=launch.scaling:main",
            "moe-import=launch.import_hf:main",
        ]
    },
)
