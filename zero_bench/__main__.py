from zero_bench.cli import main

main()
