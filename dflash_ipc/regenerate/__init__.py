"""`dflash-ipc regenerate`: the target writes the replies of a chat dataset, turn by turn.

conversation.py  one row's turns: which are kept, which the target replaces
options.py       the generation options a run is keyed by
scheduler.py     length buckets and token-budget batches (hf backend)
generator.py     transformers generate on one device (one batch at a time)
hf.py            the hf backend: render, batch, generate here or on devices.py's one process per device
openai.py        an OpenAI-compatible server the user runs (vLLM, SGLang)
output.py        the resumable output file, its rejects and its state
run.py           the loop that ties them together
"""
