"""Experiment: parallel_throughput.py with the pipeline's cuDNN refusal lifted."""
import dataclasses, runpy, sys
import jaxllm.parallel as P
orig = P.check_pipeline
P.check_pipeline = lambda model, n: orig(dataclasses.replace(model, attention_impl="xla"), n)
sys.argv = ["benchmarks/parallel_throughput.py", *sys.argv[1:]]
sys.path.insert(0, "benchmarks")
runpy.run_path("benchmarks/parallel_throughput.py", run_name="__main__")
