from engine.serve import main

if __name__ == "__main__":  # NOTE: the HTTP process is spawned: it imports this module too
    main()
