from bench.loadgen.cli import main

raise SystemExit(main())
