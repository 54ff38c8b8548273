"""The decoding core regenerate and eval run on: a static row cache, continuous batching,
token choice on the device, CUDA graphs of the decode step (engine.py is the loop)."""
