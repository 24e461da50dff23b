from tilec.cli import main

main()
