/* Cost-aware placement core (_costplace.c), called by _fastplan.c. */
#ifndef DS_FSSDP_COSTPLACE_H
#define DS_FSSDP_COSTPLACE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    /* seconds (planner/cost_place.py: Coefficients) */
    double row, intra, inter, chunk_intra, chunk_inter, window;
} CostCoefficients;

size_t cost_place_scratch(int64_t E, int64_t D, int64_t G);
void cost_place_core(const int64_t *owner, const double *T, uint8_t *P, int64_t E, int64_t D, int64_t G, int64_t t,
                     int64_t m, const CostCoefficients *c, double margin, const double *levels, int64_t num_levels,
                     double min_gain, char *scratch);

#endif
