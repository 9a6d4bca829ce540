"""The producer role (`fanout produce`): run the verifier once, publish windows.

Owns: capturing hidden states and greedy targets for a window (capture) and the
producer process: the loop — backpressure at K live windows, recapture, the role's
claim (producer); which rows window w holds (stream); publishing and committing
windows, inline or overlapped (publisher); the run directory it sets up and, after
a failed start, removes (run_start); stopping on SIGINT/SIGTERM (stopping); its
counters (stats); a verifier that changes between windows (verifier_follow).

May import: coord, store, regen, data, checkpoints (a versioned verifier's layout),
families, model, ops and the core. Never the trainer side (train/): the two roles meet
only through the store and the coordinator.
"""
