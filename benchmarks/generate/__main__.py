from benchmarks.generate.cli import main

raise SystemExit(main())
