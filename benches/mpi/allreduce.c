/* MPI_Allreduce of COUNT floats (sum, in place), timed like benches/processes.rs times the
 * host provider: WARMUP calls, a barrier, then ITERS calls; rank 0 prints the slowest
 * rank's seconds per call. Built with mpicc and run under mpirun by that bench. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (argc != 4) {
        if (rank == 0) fprintf(stderr, "usage: allreduce COUNT ITERS WARMUP\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t count = strtoull(argv[1], NULL, 10);
    int iters = atoi(argv[2]), warmup = atoi(argv[3]);
    float *buf = malloc(count * sizeof(float));
    if (!buf) MPI_Abort(MPI_COMM_WORLD, 1);
    for (size_t i = 0; i < count; i++) buf[i] = 1.0f;
    for (int i = 0; i < warmup; i++)
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++)
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double t = MPI_Wtime() - t0, slowest = 0;
    MPI_Reduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) printf("SECONDS_PER_CALL %.9f\n", slowest / iters);
    free(buf);
    MPI_Finalize();
    return 0;
}
