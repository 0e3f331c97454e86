"""The sub-commands cli.py dispatches to, each taking the composed config and returning an exit code.

subcommands.py  COMMANDS: run, maxbatch, maxseq, report, estimate, doctor, status, calibrate -> one function each
doctor.py       `zero_bench doctor`: can this machine run what the config asks? one line per check
calibrate.py    `zero_bench calibrate`: this machine's fixed terms, measured in one short real launch
"""
