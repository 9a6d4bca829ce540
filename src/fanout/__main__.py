"""`python -m fanout …`: the same as the `fanout` command (fanout.cli).

python -m fanout train --help
"""

from fanout.cli import main

raise SystemExit(main())
