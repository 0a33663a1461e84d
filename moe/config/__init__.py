"""The run's configuration: the schema of one YAML file (``run.py``: model, data, train,
parallel, logging, checkpoint, eval) and its ``launch:`` section (``launch.py``). Above the model
and the data pipeline, whose configs it holds; below training, evaluation, tools and launch."""
