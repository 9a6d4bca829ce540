"""Window artifacts on the shared filesystem: the file format and the run directory.

Owns: the window file format and its checksums (windowfile), its verified reads
(windowreader), and the run directory with the publish protocol (tmp → fsync → link →
dir fsync), its sweep and what counts as debris (store).

May import: data, model, ops and the core. Knows nothing of leases or consumers:
the coordinator decides which windows live, the store only writes and reads them.
"""
