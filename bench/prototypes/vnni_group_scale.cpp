// Ad hoc prototype (not built by the package; numbers in docs/benchmarks.md, "Two loops that did not pay"): the
// batch-1 4-bit x int8 loop of csrc/kernels/avx512/q4_int8.cpp with one activation scale per block of 32 (`cur`: one
// convert + FMA per row pair per chunk, the group scale applied per group) against one per group of 128 (`grp`:
// int32 sums over the whole group, one convert + multiply + FMA per row pair per group, the group's scales
// stored ready as [s_2j x 8, s_2j+1 x 8]), alternating calls, median thread CPU time.
//   g++ -O3 -march=x86-64-v3 -o vnni_group_scale vnni_group_scale.cpp && ./vnni_group_scale N K COPIES
// COPIES = 1: the same weights every call (in cache); more: cold copies, each loop reading its own.
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <chrono>
#include <ctime>
#include <cstring>
#include <algorithm>
static double cpu_us(){timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec*1e6+t.tv_nsec/1e3;}
constexpr int G=128;
// w: [tiles][K/64][4 rows][32 B]; s: [tiles][groups][4] floats; xi: [K] chunk order; d32: [K/64][8]; dg: [K/128]
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
void cur(const uint8_t* w, const float* s, int N, int K, const int8_t* xi, const float* dpair, float* y){
  const int pairs=K/64, groups=K/G;
  const __m512i nib=_mm512_set1_epi8(15);
  for(int i=0;i<N/4;i++){
    const uint8_t* wt=w+(size_t)i*pairs*128; const float* st=s+(size_t)i*groups*4;
    __m512 total[2]={_mm512_setzero_ps(),_mm512_setzero_ps()};
    for(int g=0;g<groups;g++){
      __m512 acc[2]={_mm512_setzero_ps(),_mm512_setzero_ps()};
      for(int p=g*2;p<g*2+2;p++){
        __m512i xlo=_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xi+p*64)));
        __m512i xhi=_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xi+p*64+32)));
        __m512 d=_mm512_broadcast_f32x8(_mm256_loadu_ps(dpair+p*8));
        for(int j=0;j<2;j++){
          __m512i v=_mm512_loadu_si512(wt+(p*4+2*j)*32);
          __m512i lo=_mm512_and_si512(v,nib), hi=_mm512_and_si512(_mm512_srli_epi16(v,4),nib);
          __m512i dot=_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(),lo,xlo),hi,xhi);
          acc[j]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),d,acc[j]);
        }
      }
      for(int j=0;j<2;j++){
        __m512 sc=_mm512_insertf32x8(_mm512_set1_ps(st[g*4+2*j]),_mm256_set1_ps(st[g*4+2*j+1]),1);
        total[j]=_mm512_fmadd_ps(acc[j],sc,total[j]);
      }
    }
    for(int j=0;j<2;j++){ y[i*4+2*j]=_mm512_reduce_add_ps(_mm512_castps256_ps512(_mm512_castps512_ps256(total[j]))); y[i*4+2*j+1]=_mm512_reduce_add_ps(total[j]);}
  }
}
// per-group activation scale: int32 sums over the group, one cvt + fma per row pair per group with s16 = ready [s_2j x8, s_2j+1 x8]
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
void grp(const uint8_t* w, const float* s16, int N, int K, const int8_t* xi, const float* dg, float* y){
  const int pairs=K/64, groups=K/G;
  const __m512i nib=_mm512_set1_epi8(15);
  for(int i=0;i<N/4;i++){
    const uint8_t* wt=w+(size_t)i*pairs*128; const float* st=s16+(size_t)i*groups*32;
    __m512 total[2]={_mm512_setzero_ps(),_mm512_setzero_ps()};
    for(int g=0;g<groups;g++){
      __m512i dot[2]={_mm512_setzero_si512(),_mm512_setzero_si512()};
      for(int p=g*2;p<g*2+2;p++){
        __m512i xlo=_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xi+p*64)));
        __m512i xhi=_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xi+p*64+32)));
        for(int j=0;j<2;j++){
          __m512i v=_mm512_loadu_si512(wt+(p*4+2*j)*32);
          __m512i lo=_mm512_and_si512(v,nib), hi=_mm512_and_si512(_mm512_srli_epi16(v,4),nib);
          dot[j]=_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[j],lo,xlo),hi,xhi);
        }
      }
      const __m512 d=_mm512_set1_ps(dg[g]);
      for(int j=0;j<2;j++) total[j]=_mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[j]),d),_mm512_loadu_ps(st+g*32+16*j),total[j]);
    }
    for(int j=0;j<2;j++){ y[i*4+2*j]=_mm512_reduce_add_ps(_mm512_castps256_ps512(_mm512_castps512_ps256(total[j]))); y[i*4+2*j+1]=_mm512_reduce_add_ps(total[j]);}
  }
}
int main(int argc,char**argv){
  int N=atoi(argv[1]),K=atoi(argv[2]); int copies=atoi(argv[3]);
  size_t wb=(size_t)N*K/2;
  std::vector<std::vector<uint8_t>> W(copies,std::vector<uint8_t>(wb));
  for(auto&v:W) for(auto&b:v) b=rand();
  std::vector<float> s(N/4*(K/G)*4,0.01f), s16(N/4*(K/G)*32,0.01f), dp(K/64*8,0.1f), dg(K/G,0.1f), y(N);
  std::vector<int8_t> xi(K); for(auto&b:xi) b=rand()%255-127;
  double tc=0,tg=0; int reps=400;
  std::vector<double> A,B;
  for(int r=0;r<reps;r++){
    double t0=cpu_us(); cur(W[r%copies].data(),s.data(),N,K,xi.data(),dp.data(),y.data()); double t1=cpu_us();
    grp(W[(r+copies/2)%copies].data(),s16.data(),N,K,xi.data(),dg.data(),y.data()); double t2=cpu_us();
    A.push_back(t1-t0); B.push_back(t2-t1);
  }
  std::sort(A.begin(),A.end()); std::sort(B.begin(),B.end());
  printf("%dx%d copies %d: cur %.1f us (%.1f Gc/s)  grp %.1f us (%.1f Gc/s)  ratio %.2f\n",N,K,copies,A[reps/2],N*(double)K/A[reps/2]/1e3,B[reps/2],N*(double)K/B[reps/2]/1e3,A[reps/2]/B[reps/2]);
}
