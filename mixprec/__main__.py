from mixprec.cli import main

raise SystemExit(main())
