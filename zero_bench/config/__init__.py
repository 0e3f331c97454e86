"""What the user asked for, typed and checked: the schema (one dataclass per section, the one
source of defaults), composing conf/ over it and checking every key, and where the ranks run.

schema.py     BenchConfig and its sections, every key's type, default and docstring
choices.py    the StrEnum each choice key takes (Device, Precision, Recompute, ...)
command.py    what a sub-command does with them: the search: and report: sections
checked.py    a plain dict checked against a section: one line per bad key; stored configs' migrations
stored.py     stored configs read back: the one reader (the report's)
configure.py  Hydra composition + every check: bad input is one line naming the key, exit 2
layout.py     RankLayout: the parallel degrees validated once, the groups, where each parameter lives
honoured.py   which keys the chosen engine, stage and device read: the rest refused (or warned)
hosts.py      the GPUs of a node, the hostfile DeepSpeed's launcher reads, the master address
"""
