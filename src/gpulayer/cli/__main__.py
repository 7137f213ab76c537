from gpulayer.cli import _main

_main()
