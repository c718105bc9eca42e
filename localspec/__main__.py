from localspec.cli.main import main

main()
