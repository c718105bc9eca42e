from localspec.cli.app import main

main()
