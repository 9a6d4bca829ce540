#!/usr/bin/env python
"""Train one draft of any family (--draft-family) as a consumer of a fanout run
(same as `fanout train`).

    python scripts/train.py --run-dir runs/r1 --consumer-id draft-b8 \
        --verifier-name-or-path VERIFIER_DIR --block-size 8 --save-path runs/r1/drafts/b8

`--help` lists every flag; see docs/training.md.
"""

import sys

from fanout.train.trainer import main

if __name__ == "__main__":
    sys.exit(main())
